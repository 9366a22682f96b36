"""Self-distillation data for the draft head: chat instructions, the target's own responses to
them, and the target's hidden state at every position of prompt + response.

Instructions are templates x topics. The eval split holds out whole topics (none of their words
is seen in training), so the acceptance it measures is the one a new chat prompt gets.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from inferd.engine.model_runner import allocate_kv_cache
from inferd.layers.attention import AttentionMetadata, PrefillSlice

if TYPE_CHECKING:
    from inferd import LLM

TEMPLATES = (
    "Explain {t} to a beginner.",
    "Write a short poem about {t}.",
    "Give me three practical tips about {t}.",
    "What are the pros and cons of {t}?",
    "Write a short story that involves {t}.",
    "Summarize the history of {t} in one paragraph.",
    "How would you explain {t} to a ten-year-old?",
    "List five interesting facts about {t}.",
    "Write a friendly email to a colleague about {t}.",
    "What is a common misconception about {t}?",
    "Describe {t} in simple words.",
    "Why does {t} matter today?",
    "Give a step-by-step guide to getting started with {t}.",
    "Write a short blog post introduction about {t}.",
    "What questions should I ask an expert on {t}?",
    "Compare {t} with something most people already know.",
    "What is {t}?",
    "How does {t} work?",
    "Tell me something surprising about {t}.",
    "What should everyone know about {t}?",
    "Can you help me understand {t}?",
    "What are the most important things to learn about {t}?",
    "Write a haiku about {t}.",
    "What would the world be like without {t}?",
    "Give me a fun quiz question about {t} and its answer.",
    "What are some good books or resources for learning about {t}?",
    "I am curious about {t}. Where should I start?",
    "Write a short dialogue between two friends talking about {t}.",
    "What are the main benefits of {t}?",
    "What problems are caused by {t}, and how can they be solved?",
    "Explain the basic ideas behind {t} in a few sentences.",
    "Give me an example that shows how {t} works in everyday life.",
)
TOPICS = (
    "photosynthesis", "black holes", "the French Revolution", "machine learning", "coffee",
    "volcanoes", "the stock market", "bicycles", "the immune system", "Python programming",
    "climate change", "the Moon", "chess", "honeybees", "electricity", "the Roman Empire",
    "sleep", "recycling", "music theory", "the internet", "gardening", "earthquakes", "vaccines",
    "cooking pasta", "the ocean", "renewable energy", "dinosaurs", "friendship",
    "time management", "the human brain", "rainforests", "airplanes", "prime numbers",
    "the water cycle", "democracy", "cats", "running", "saving money", "the solar system",
    "learning a new language", "public speaking", "bread baking", "the printing press",
    "databases", "origami", "jazz", "glaciers", "volunteering",
    "dogs", "rainbows", "the pyramids of Egypt", "nutrition", "yoga", "photography",
    "smartphones", "electric cars", "the Olympic Games", "mountains", "deserts", "coral reefs",
    "the human heart", "exercise", "budgeting", "job interviews", "writing a resume",
    "camping", "traveling abroad", "the Renaissance", "ancient Greece", "World War II",
    "the Industrial Revolution", "gravity", "magnets", "atoms", "DNA", "evolution",
    "the periodic table", "algebra", "geometry", "statistics", "probability", "fractions",
    "computer viruses", "cybersecurity", "cloud computing", "video games", "social media",
    "artificial intelligence", "robots", "space travel", "Mars", "satellites", "telescopes",
    "the weather", "hurricanes", "snow", "rivers", "forests", "birds", "whales", "ants",
    "butterflies", "sharks", "elephants", "penguins", "the Amazon River", "Antarctica",
    "pizza", "chocolate", "cheese", "vegetables", "breakfast", "healthy eating", "water",
    "the piano", "the guitar", "classical music", "painting", "poetry", "theater", "movies",
    "libraries", "museums", "schools", "homework", "exams", "teamwork", "leadership",
    "kindness", "happiness", "stress", "habits", "motivation", "creativity", "curiosity",
    "the economy", "inflation", "taxes", "banks", "small businesses", "marketing",
    "emails", "meetings", "remote work", "cities", "trains", "bridges", "skyscrapers",
    "plastic pollution", "solar panels", "nuclear power", "batteries", "light", "sound",
    "the seasons", "calendars", "clocks", "maps", "the alphabet", "numbers", "soccer",
    "basketball", "swimming", "cycling races", "board games", "puzzles", "magic tricks",
)
# Topics only the eval split uses.
EVAL_TOPICS = ("the moon landing", "wind turbines", "octopuses", "meditation",
               "the Great Wall of China", "spreadsheets", "thunderstorms", "volcanic islands")
# Questions unlike the templates (the kind `inferd bench spec --tasks chat` asks), for the eval
# split only: acceptance on them says how well the head generalises beyond the recipe's forms.
EVAL_QUESTIONS = (
    "How do I fix a flat tire on my bike?",
    "What is a good way to start learning to draw?",
    "Why do leaves change color in autumn?",
    "Can you suggest a simple dinner I can cook in twenty minutes?",
    "What is the difference between weather and climate?",
    "How can I stay focused while studying at home?",
    "What are some fun things to do on a rainy day?",
    "How do airplanes stay in the air?",
)  # fmt: skip


def instructions(split: str, n: int, seed: int = 0) -> list[str]:
    """`n` distinct chat instructions of the "train" or "eval" split, shuffled with `seed` (the
    eval split's free-form questions come first)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', not {split!r}")
    topics = TOPICS if split == "train" else EVAL_TOPICS
    pool = [t.format(t=topic) for topic in topics for t in TEMPLATES]
    random.Random(seed).shuffle(pool)
    if split == "eval":
        pool = list(EVAL_QUESTIONS) + pool
    if n > len(pool):
        raise ValueError(f"the {split} split has {len(pool)} instructions, {n} asked")
    return pool[:n]


# Self-instruct: the target itself writes free-form questions (how-to, why, advice...), so that
# the head also trains on instructions unlike the templates above. Subjects are everyday ones plus
# the training topics; nothing from the eval split or `inferd bench spec`'s prompts is kept.
QUESTION_SEEDS = (
    "Write one question that a curious person might ask about {t}. Reply with the question only.",
    "Write one practical how-to question about {t}. Reply with the question only.",
    "Write one question that starts with 'Why' about {t}. Reply with the question only.",
    "Write one question asking for advice or ideas about {t}. Reply with the question only.",
    "Write one question a student might ask a teacher about {t}. Reply with the question only.",
    "Write one simple question about {t} that has a short answer. Reply with the question only.",
)
EVERYDAY = (
    "cooking", "travel", "pets", "health", "school", "work", "hobbies", "home repair", "family",
    "shopping", "sports", "money", "weather", "nature", "technology", "cars", "clothes",
    "holidays", "books", "music", "art", "science", "history", "games", "gardens", "cleaning",
    "fitness", "food", "friends", "learning", "writing", "computers", "phones", "the city",
    "the countryside", "animals", "plants", "the body", "emotions", "jobs", "parties",
    "the kitchen", "the beach", "winter", "summer", "breakfast", "sleep habits", "languages",
)  # fmt: skip


def _words(text: str) -> set[str]:
    return {w.strip(".,!?;:'\"()").lower() for w in text.split()} - {""}


def question_prompts(n: int, seed: int = 0) -> list[str]:
    """`n` prompts asking the target to write a question (seeds x everyday and training topics)."""
    pool = [s.format(t=t) for t in EVERYDAY + TOPICS for s in QUESTION_SEEDS]
    rng = random.Random(seed)
    rng.shuffle(pool)
    return [pool[i % len(pool)] for i in range(n)]


def clean_questions(texts: list[str], held_out: list[str]) -> list[str]:
    """The usable questions among the target's replies: the first line, unquoted, one question
    of 4-40 words; no duplicates, none sharing most of its words with a held-out prompt."""
    held = [_words(h) for h in held_out]
    seen: set[str] = set()
    out = []
    for text in texts:
        line = text.strip().split("\n")[0].strip()
        # "A curious person might ask: \"Why ...?\"" -> the quoted question
        for mark in (': "', ', "', ": ", "Question:", "Q:"):
            if mark in line:
                line = line.rsplit(mark, 1)[1]
        line = line.strip().strip('"').strip()
        words = _words(line)
        if (not line.endswith("?") or not 4 <= len(line.split()) <= 40 or line.count("?") > 1
                or "question" in words or "questions" in words):  # fmt: skip
            continue
        key = " ".join(sorted(words))
        if key in seen or any(len(words & h) >= 0.6 * min(len(words), len(h)) for h in held):
            continue
        seen.add(key)
        out.append(line)
    return out


def self_instruct(llm: LLM, n: int, held_out: list[str], seed: int = 0) -> list[str]:
    """Up to `n` distinct questions written by the target (`llm`: inferd.LLM), sampled at
    temperature 0.9 from `question_prompts`; see `clean_questions`."""
    from inferd.sampling.params import SamplingParams

    prompts = question_prompts(2 * n, seed)  # about half the replies are usable questions
    tok = llm.get_tokenizer()
    chats = [[{"role": "user", "content": p}] for p in prompts]
    ids = [
        tok.encode(tok.apply_chat_template(c, add_generation_prompt=True), add_special_tokens=False)
        for c in chats
    ]
    params = [
        SamplingParams(temperature=0.9, top_p=0.95, max_tokens=48, seed=seed + i)
        for i in range(len(ids))
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    return clean_questions([o.outputs[0].text for o in outs], held_out)[:n]


def generate_sequences(
    llm: LLM,
    prompts: list[str],
    max_tokens: int,
    temperatures: list[float],
    seed: int = 0,
    progress: bool = False,
) -> tuple[list[list[int]], list[int]]:
    """Token ids of chat prompt + the target's response, one list per prompt (`llm`: inferd.LLM),
    and each prompt's length in tokens."""
    from inferd.sampling.params import SamplingParams

    tok = llm.get_tokenizer()
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}],
                                              add_generation_prompt=True), add_special_tokens=False)
           for p in prompts]  # fmt: skip
    params = [SamplingParams(temperature=t, max_tokens=max_tokens, seed=seed + i)
              for i, t in enumerate(temperatures)]  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=progress)
    return [p + list(o.outputs[0].token_ids) for p, o in zip(ids, outs)], [len(p) for p in ids]


@dataclass(slots=True)
class HiddenStates:
    """Per sequence: its tokens [T] and the target's hidden states [T, H] (CPU), or [T, H * (1 + n)]
    with the outputs of n captured layers after the final hidden state (`target_hidden_states`)."""

    tokens: list[torch.Tensor]
    hidden: list[torch.Tensor]


@torch.inference_mode()
def target_hidden_states(
    model: torch.nn.Module,
    sequences: list[list[int]],
    max_batch_tokens: int = 2048,
    capture_layers: tuple[int, ...] = (),
) -> HiddenStates:
    """Run the target over each whole sequence (several per forward, each a prefill with no earlier
    context) and keep its hidden states after the final norm, as the engine's forward returns,
    followed by the outputs of `capture_layers` (ascending) when given."""
    cfg = model.config
    device = model.norm.weight.device
    block = 16
    longest = max(len(s) for s in sequences)
    nblocks = (max(max_batch_tokens, longest) + block - 1) // block + len(sequences)
    kv = allocate_kv_cache(cfg, nblocks, block, model.norm.weight.dtype, device)
    caches = [(kv[i, 0], kv[i, 1]) for i in range(cfg.num_layers)]
    out_tokens, out_hidden = [], []
    i = 0
    while i < len(sequences):
        batch, total = [], 0
        while i < len(sequences) and (not batch or total + len(sequences[i]) <= max_batch_tokens):
            batch.append(sequences[i])
            total += len(sequences[i])
            i += 1
        # Each sequence owns whole blocks: rows [row, row + t), slots from its first block on.
        slices, slots, next_block = [], [], 0
        row = 0
        for seq in batch:
            t = len(seq)
            nb = (t + block - 1) // block
            table = torch.arange(next_block, next_block + nb, device=device)
            slices.append(PrefillSlice(row, row + t, t, table, None))
            slots.append(torch.arange(t, device=device) + next_block * block)
            next_block += nb
            row += t
        meta = AttentionMetadata(slot_mapping=torch.cat(slots), block_size=block, group=None,
                                 prefills=slices)  # fmt: skip
        flat = torch.tensor([x for s in batch for x in s], device=device)
        pos = torch.cat([torch.arange(len(s), device=device) for s in batch])
        model.capture_layers = capture_layers
        try:
            hidden = model(flat, pos, caches, meta)
            if capture_layers:
                hidden = torch.cat([hidden, *model.captured], dim=-1)
        finally:
            model.capture_layers, model.captured = (), []
        hidden = hidden.float().cpu()
        for s, sl in zip(batch, slices):
            out_tokens.append(torch.tensor(s))
            out_hidden.append(hidden[sl.start : sl.end].clone())
    return HiddenStates(out_tokens, out_hidden)
