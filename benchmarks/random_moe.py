"""A random mixture-of-experts checkpoint of a realistic shape for `inferd bench`, written by
transformers' own OLMoE class (fp32 safetensors) with the default model's tokenizer: 64 experts,
top 8, at a reduced width and depth so that it fits a small machine. Random weights: the figures
it gives are speed, not quality.

    python benchmarks/random_moe.py /tmp/olmoe-like            # from the repository root
    inferd bench latency --model /tmp/olmoe-like -q int4 --peers hf
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inferd.loader import load_model  # noqa: E402


def write(out: Path, hidden: int, layers: int, experts: int, top_k: int, expert_size: int) -> None:
    import transformers

    tok = load_model(None, verbose=False).tokenizer  # the default model's vocabulary
    vocab = tok.hf.get_vocab_size(with_added_tokens=True)
    config = transformers.OlmoeConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=expert_size, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, num_experts=experts,
        num_experts_per_tok=top_k, max_position_embeddings=4096, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_ids[0], pad_token_id=tok.eos_token_ids[0], tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.OlmoeForCausalLM(config).float().eval()
    with torch.no_grad():  # decisive logits: unit embeddings, fan-in-scaled projections
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif "embed_tokens" in name or "lm_head" in name:
                p.normal_()
            else:
                p.normal_(std=p.shape[-1] ** -0.5)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.hf.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": tok.chat_template}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--expert-size", type=int, default=512)
    a = p.parse_args()
    write(a.out, a.hidden, a.layers, a.experts, a.top_k, a.expert_size)


if __name__ == "__main__":
    main()
