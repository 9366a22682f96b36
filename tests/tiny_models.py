"""Writers of tiny random-weight Llama-family models, as GGUF files and as HF directories.

The GGUF side writes what llama.cpp's `convert_hf_to_gguf.py` writes (metadata keys, tensor names,
Q/K rows permuted for llama.cpp's rope, a byte-level BPE vocabulary with merges); the HF side writes
`config.json`, `*.safetensors` (single or sharded with an index), `tokenizer.json`,
`tokenizer_config.json` and `generation_config.json`. Every writer returns a `TinyModel` that keeps
the weights a correct loader must produce (HF names, fp32), so tests can compare exactly.

Nothing here imports the engine: the permutation, the tokenizer and the names are written from
llama.cpp's and HF's conventions so that a loader bug cannot cancel itself out.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf_quantizers import quantize_blocks
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

# Special tokens in SmolLM2's order: <|endoftext|> 0, <|im_start|> 1 (BOS), <|im_end|> 2 (EOS).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_TOKEN, EOS_TOKEN = "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The split regexes of Llama 3's and Qwen2's tokenizer.json (what llama.cpp calls "llama-bpe" and
# "qwen2"); they differ only in how digits group (\p{N}{1,3} vs \p{N}).
_SPLIT_REGEX = {
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}

_CORPUS_LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "A paged KV cache stores keys and values in fixed-size blocks of sixteen tokens.",
    "Continuous batching lets requests join and leave the running batch at every step.",
    "In 2024 there were 365 days, 8784 hours and 527040 minutes; 3.14159 is close to pi.",
    "Counting: 123 456 789 123456 456789 100 200 300 2024 2025 1234567890.",
    "Café, naïve, résumé — Grüße aus München! Ελληνικά, русский, 日本語のテキスト, 中文。",
    "def forward(self, x):\n    return self.proj(x) + 1  # residual\n",
    "She said: \"don't stop,\" and we're sure they'll say it's fine, isn't it?",
    "Emoji also happen: 🙂 🚀 ✨ and tabs\tand   runs of   spaces.",
]


@dataclass(frozen=True)
class TinySpec:
    """Hyper-parameters of a tiny model; `seed` picks the random weights."""

    arch: str = "llama"  # "llama" or "qwen2" (q/k/v biases, no Q/K permutation in GGUF)
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 128
    max_position: int = 256
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    tied: bool = False
    seed: int = 0

    @property
    def pre(self) -> str:
        """llama.cpp's `tokenizer.ggml.pre` for this model's tokenizer."""
        return "qwen2" if self.arch == "qwen2" else "llama-bpe"

    @property
    def hf_architecture(self) -> str:
        return {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[self.arch]


# K-quants hold rows of 256-weight super-blocks: every input dim (hidden, intermediate) a multiple.
KQUANT_SPEC = TinySpec(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512)


@dataclass
class TinyModel:
    path: Path
    spec: TinySpec
    tokenizer: Tokenizer | None  # the HF `tokenizers` tokenizer the model was written with
    # What a correct loader returns: HF names, fp32 (dequantized where the file is quantized).
    weights: dict[str, torch.Tensor]
    # The random fp32 weights before any quantization (equal to `weights` for F32 files).
    original: dict[str, torch.Tensor]
    tensor_types: dict[str, QType] = field(default_factory=dict)  # GGUF only: name → type

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int:
        return self.tokenizer.token_to_id(BOS_TOKEN)

    @property
    def eos_id(self) -> int:
        return self.tokenizer.token_to_id(EOS_TOKEN)


# ---- tokenizer -------------------------------------------------------------------------------
@functools.cache
def build_tokenizer(pre: str = "llama-bpe", vocab_size: int = 400) -> Tokenizer:
    """A byte-level BPE tokenizer trained in memory (deterministic), with ChatML special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_REGEX[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS_LINES * 8, trainer=trainer)
    return tok


def _merges(tok: Tokenizer) -> list[str]:
    merges = json.loads(tok.to_str())["model"]["merges"]
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


# ---- weights ---------------------------------------------------------------------------------
def make_state_dict(spec: TinySpec, vocab_size: int) -> dict[str, torch.Tensor]:
    """Random fp32 weights in HF naming. Scaled so logits spread widely: greedy has no near-ties."""
    g = torch.Generator().manual_seed(spec.seed)

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    def norm() -> torch.Tensor:
        return 1.0 + rand(spec.hidden, scale=0.1)

    h, i = spec.hidden, spec.intermediate
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rand(vocab_size, h, scale=1.0)}
    for layer in range(spec.layers):
        p = f"model.layers.{layer}."
        sd[p + "input_layernorm.weight"] = norm()
        sd[p + "self_attn.q_proj.weight"] = rand(q, h, scale=h**-0.5)
        sd[p + "self_attn.k_proj.weight"] = rand(kv, h, scale=h**-0.5)
        sd[p + "self_attn.v_proj.weight"] = rand(kv, h, scale=h**-0.5)
        if spec.arch == "qwen2":
            sd[p + "self_attn.q_proj.bias"] = rand(q, scale=0.1)
            sd[p + "self_attn.k_proj.bias"] = rand(kv, scale=0.1)
            sd[p + "self_attn.v_proj.bias"] = rand(kv, scale=0.1)
        sd[p + "self_attn.o_proj.weight"] = rand(h, q, scale=q**-0.5)
        sd[p + "post_attention_layernorm.weight"] = norm()
        sd[p + "mlp.gate_proj.weight"] = rand(i, h, scale=h**-0.5)
        sd[p + "mlp.up_proj.weight"] = rand(i, h, scale=h**-0.5)
        sd[p + "mlp.down_proj.weight"] = rand(h, i, scale=i**-0.5)
    sd["model.norm.weight"] = norm()
    if not spec.tied:
        sd["lm_head.weight"] = rand(vocab_size, h, scale=1.0)
    return sd


# ---- GGUF ------------------------------------------------------------------------------------
def add_gguf_tokenizer(w: gguf.GGUFWriter, tok: Tokenizer, pre: str) -> None:
    """The byte-level BPE tokenizer's metadata as convert_hf_to_gguf.py writes it."""
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(
        [gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in tokens]
    )
    w.add_token_merges(_merges(tok))
    w.add_bos_token_id(vocab[BOS_TOKEN])
    w.add_eos_token_id(vocab[EOS_TOKEN])
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's `LlamaModel.permute`: HF's half-split rope rows → interleaved."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.{i}.{rest}
    return f"blk.{layer}.{_GGUF_LAYER[rest]}"


# Quantization presets: the type of each 2-D weight by GGUF name; 1-D tensors (norms, biases) stay
# F32 as llama.cpp keeps them. "mixed" resembles the default model (Q4_1 body, Q8_0 embedding);
# "kquants" holds every type inferd keeps packed, layer 0 as Gemma 3's Q4_K_M mixes them (Q5_0 q/k
# beside a Q8_0 v); "lowbit" the types it dequantizes at load. Both need K-quants' blocks of 256
# along K: KQUANT_SPEC's sizes.
_KQUANT_TYPES = {
    "token_embd": QType.Q8_0, "output": QType.Q6_K,
    "0.attn_q": QType.Q5_0, "0.attn_k": QType.Q5_0, "0.attn_v": QType.Q8_0, "0.attn_output": QType.Q4_K,
    "0.ffn_gate": QType.Q5_1, "0.ffn_up": QType.Q5_1, "0.ffn_down": QType.Q6_K,
    "1.attn_q": QType.Q5_K, "1.attn_k": QType.Q5_K, "1.attn_v": QType.Q5_K, "1.attn_output": QType.Q6_K,
    "1.ffn_gate": QType.Q4_K, "1.ffn_up": QType.Q4_K, "1.ffn_down": QType.Q5_K,
}  # fmt: skip
_LOWBIT_TYPES = {"token_embd": QType.Q8_0, "output": QType.F16, "attn_q": QType.Q2_K, "attn_k": QType.Q3_K,
                 "attn_v": QType.IQ4_NL, "attn_output": QType.MXFP4}  # fmt: skip


def _quant_type(preset: str, name: str) -> QType:
    if preset == "f32":
        return QType.F32
    if preset in ("q8_0", "q4_0", "q4_1", "f16"):
        return QType[preset.upper()]
    key = name.removeprefix("blk.").removesuffix(".weight")
    if preset == "kquants":
        return _KQUANT_TYPES[key]
    if preset == "lowbit":
        return _LOWBIT_TYPES.get(key.split(".")[-1], QType.Q4_K)
    assert preset == "mixed", preset
    if name == "token_embd.weight":
        return QType.Q8_0
    if name == "output.weight":
        return QType.F16
    if ".attn_" in name:
        return QType.Q4_1
    if ".ffn_down" in name:
        return QType.Q8_0
    return QType.Q4_0


def write_gguf(
    path: Path,
    spec: TinySpec,
    quant: str = "f32",
    *,
    architecture: str | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
    vocab: Any = None,
) -> TinyModel:
    """Write a GGUF like convert_hf_to_gguf.py would. `architecture` overrides general.architecture
    (to write files of an architecture the engine does not support). `vocab` (with `tokens` and
    `write(writer)`, as tiny_tokenizers' SentencePiece vocabularies) replaces the byte-level BPE
    vocabulary; the model's `tokenizer` is then None."""
    tok = build_tokenizer(spec.pre) if vocab is None else None
    if tok is not None:
        ids = tok.get_vocab(with_added_tokens=True)
        tokens = [t for t, _ in sorted(ids.items(), key=lambda kv: kv[1])]
        assert [ids[t] for t in tokens] == list(range(len(tokens)))
    else:
        tokens = list(vocab.tokens)
    sd = state_dict if state_dict is not None else make_state_dict(spec, len(tokens))
    arch = architecture or spec.arch

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{spec.arch}")
    w.add_context_length(spec.max_position)
    w.add_embedding_length(spec.hidden)
    w.add_feed_forward_length(spec.intermediate)
    w.add_block_count(spec.layers)
    w.add_head_count(spec.heads)
    w.add_head_count_kv(spec.kv_heads)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    w.add_rope_dimension_count(spec.head_dim)
    w.add_vocab_size(len(tokens))
    ftype = gguf.LlamaFileType
    w.add_file_type(ftype.ALL_F32 if quant == "f32" else ftype.MOSTLY_Q4_K_M if quant == "kquants"
                    else ftype.MOSTLY_Q8_0)  # fmt: skip
    if tok is None:
        vocab.write(w)
    else:
        add_gguf_tokenizer(w, tok, spec.pre)

    expected: dict[str, torch.Tensor] = {}
    types: dict[str, QType] = {}
    for hf, tensor in sd.items():
        name = gguf_name(hf)
        arr = tensor.numpy().astype(np.float32)
        permuted = spec.arch != "qwen2" and hf.endswith(("q_proj.weight", "k_proj.weight"))
        n_head = spec.heads if "q_proj" in hf else spec.kv_heads
        if permuted:
            arr = llama_cpp_permute(arr, n_head)
        qtype = _quant_type(quant, name) if arr.ndim == 2 else QType.F32
        rng = np.random.default_rng(len(types))
        data = arr if qtype == QType.F32 else quantize_blocks(arr, qtype, rng)
        w.add_tensor(name, data, raw_dtype=qtype)
        types[name] = qtype
        back = arr if qtype == QType.F32 else gguf.quants.dequantize(data, qtype).reshape(arr.shape)
        if permuted:
            back = llama_cpp_unpermute(back, n_head)
        expected[hf] = torch.from_numpy(np.ascontiguousarray(back, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return TinyModel(Path(path), spec, tok, expected, sd, types)


# ---- HF directory ----------------------------------------------------------------------------
def write_hf_dir(
    directory: Path,
    spec: TinySpec,
    *,
    num_shards: int = 1,
    state_dict: dict[str, torch.Tensor] | None = None,
    architectures: list[str] | None = None,
) -> TinyModel:
    """Write an HF model directory; `num_shards > 1` writes model-0000X-of-0000Y + index json."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(spec.pre)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    sd = state_dict if state_dict is not None else make_state_dict(spec, vocab_size)
    bos, eos = tok.token_to_id(BOS_TOKEN), tok.token_to_id(EOS_TOKEN)
    config = {
        "architectures": architectures or [spec.hf_architecture],
        "model_type": spec.arch,
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position,
        "rms_norm_eps": spec.rms_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": spec.tied,
        "attention_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    if spec.arch == "qwen2":
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=spec.layers)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer_files(directory, tok, spec.max_position)
    tensors = {k: v.contiguous() for k, v in sd.items()}
    if num_shards == 1:
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    else:
        names = list(tensors)
        weight_map: dict[str, str] = {}
        for s in range(num_shards):
            file = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[s::num_shards]}
            save_file(part, str(directory / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, file))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return TinyModel(directory, spec, tok, sd, sd)


def write_tokenizer_files(directory: Path, tok: Tokenizer, max_position: int) -> None:
    """tokenizer.json, tokenizer_config.json and generation_config.json as HF writes them."""
    bos, eos = tok.token_to_id(BOS_TOKEN), tok.token_to_id(EOS_TOKEN)
    (directory / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos, "eos_token_id": eos, "do_sample": False})
    )
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": BOS_TOKEN,
                "eos_token": EOS_TOKEN,
                "pad_token": SPECIAL_TOKENS[0],
                "add_bos_token": False,
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": max_position,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )


def with_seed(spec: TinySpec, seed: int) -> TinySpec:
    return dataclasses.replace(spec, seed=seed)
