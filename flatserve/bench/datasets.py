"""Benchmark datasets, built offline and deterministically, exact to the tokenizer's count.

- random: fixed input length, fixed output length (`ignore_eos` where the server takes it).
- chat: single-turn questions of ~1K input tokens (spread 0.75x..1.25x), up to 256 out.
- agent: multi-turn conversations whose every turn resends the growing history (a system
  prompt, tool calls and tool results as text), ending near ~4K tokens: shared prefixes.

Text is made of words that each encode to exactly one token after a space; every prompt is
then re-encoded and trimmed or padded until its count is exact.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Item:
    prompt: str
    prompt_tokens: int
    max_tokens: int
    conversation: int = -1  # agent: which conversation; turns of one conversation run in order


def one_token_words(tok: Any, limit: int = 3000) -> list[str]:
    words = []
    for w in ("the of and to in is you that it he was for on are as with his they at be this have "
              "from or one had by word but not what all were we when your can said there use an each "
              "which she do how their if will up other about out many then them these so some her "
              "would make like him into time has look two more write go see number no way could "
              "people my than first water been call who oil its now find long down day did get come "
              "made may part over new sound take only little work know place year live me back give "
              "most very after thing our just name good sentence man think say great where help "
              "through much before line right too mean old any same tell boy follow came want show "
              "also around form three small set put end does another well large must big even such "
              "because turn here why ask went men read need land different home us move try kind hand "
              "picture again change off play spell air away animal house point page letter mother "
              "answer found study still learn should America world high every near add food between "
              "own below country plant last school father keep tree never start city earth eye light "
              "thought head under story saw left few while along might close something seem next hard "
              "open example begin life always those both paper together got group often run important").split():
        if len(tok(" " + w, add_special_tokens=False).input_ids) == 1:
            words.append(w)
        if len(words) >= limit:
            break
    return words


def exact_text(tok: Any, rng: random.Random, words: list[str], n: int, head: str = "") -> str:
    """Text whose encoding (with the tokenizer's BOS) is exactly n tokens."""
    text = head + " ".join(rng.choice(words) for _ in range(max(1, n)))
    for _ in range(64):
        have = len(tok(text).input_ids)
        if have == n:
            return text
        if have > n:
            text = text.rsplit(" ", max(1, have - n))[0] if " " in text else text
        else:
            text = text + "".join(" " + rng.choice(words) for _ in range(n - have))
    raise ValueError(f"could not build a prompt of exactly {n} tokens")


def random_split(tok: Any, n: int, input_len: int, output_len: int, seed: int = 0) -> list[Item]:
    rng, words = random.Random(seed), one_token_words(tok)
    return [Item(t := exact_text(tok, rng, words, input_len), len(tok(t).input_ids), output_len)
            for _ in range(n)]


def chat_split(tok: Any, n: int, input_len: int = 1024, max_tokens: int = 256, seed: int = 0) -> list[Item]:
    rng, words = random.Random(seed), one_token_words(tok)
    items = []
    for i in range(n):
        target = rng.randint(int(input_len * 0.75), int(input_len * 1.25))
        text = exact_text(tok, rng, words, target, head="Question: ")
        items.append(Item(text, len(tok(text).input_ids), max_tokens))
    return items


def agent_split(tok: Any, n: int, input_len: int = 4096, max_tokens: int = 256, turns: int = 4,
                seed: int = 0) -> list[Item]:
    """n requests = ceil(n / turns) conversations x turns; the last turn is ~input_len tokens."""
    rng, words = random.Random(seed), one_token_words(tok)
    items: list[Item] = []
    conv = 0
    while len(items) < n:
        system = exact_text(tok, rng, words, max(8, input_len // 4), head="System: you are an agent.")
        history = system
        for t in range(turns):
            step = max(4, (input_len - input_len // 4) // turns - 16)
            call = " ".join(rng.choice(words) for _ in range(step // 3))
            result = " ".join(rng.choice(words) for _ in range(step // 3))
            history += f"\nTool call: {{\"name\": \"search\", \"args\": \"{call}\"}}\nTool result: {result}\nUser:"
            target = min(len(tok(history).input_ids) + step // 3, input_len)
            history = exact_text(tok, rng, words, target, head=history + " ") if target > len(
                tok(history).input_ids) else history
            items.append(Item(history, len(tok(history).input_ids), max_tokens, conv))
            if len(items) >= n:
                break
        conv += 1
    return items


def build(name: str, tok: Any, n: int, max_tokens: int, input_len: int | None = None,
          seed: int = 0) -> list[Item]:
    if name == "random":
        return random_split(tok, n, input_len or 512, max_tokens, seed)
    if name == "chat":
        return chat_split(tok, n, input_len or 1024, max_tokens, seed)
    if name == "agent":
        return agent_split(tok, n, input_len or 4096, max_tokens, seed=seed)
    raise ValueError(f"unknown dataset {name!r}; choose chat, agent or random")
