"""bench.chaos: the load that runs under every fault, and the monitor.

* **long prompts**: ``--long-clients`` clients, each sending prompts of about ``--long-words``
  words one after another, so requests queue on the prefill instances and hold decode
  reservations for seconds while the faults hit. Each prompt is new (no prefix cache helps
  its first answer) and is sent twice in a row, cold then warm (streamed one way, not the
  other); in float32 both answers must be the same text.
* a **monitor** polls the Conductor's ``/stats`` every half second through the whole run: an
  instance record with ``up`` false whose URL is not the one being faulted is a healthy
  instance marked down; it also samples the Conductor process's memory (``/proc/PID/status``).
"""

from __future__ import annotations

import asyncio
import os
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.chaos.cluster import conductor_stats
from bench.chaos.config import COMPLETIONS, progress
from bench.chaos.traffic import Outcome, send

if TYPE_CHECKING:
    from bench.chaos.run import Run

# Common English words: a prompt of n of them is about 1.3 n tokens, as prose is.
_WORDS = ["the", "of", "and", "to", "in", "is", "was", "that", "for", "on", "with", "as", "by", "at", "from", "his", "her", "they", "we", "you", "it", "this", "which", "be", "are", "were", "had", "have", "has", "not", "but", "all", "one", "can", "more", "some", "there", "when", "what", "who", "their", "time", "people", "year", "way", "day", "man", "woman", "child", "world", "life", "hand", "part", "place", "case", "week", "company", "system", "program", "question", "work", "government", "number", "night", "point", "home", "water", "room", "mother", "area", "money", "story", "fact", "month", "lot", "right", "study", "book", "eye", "job", "word", "business", "issue", "side", "kind", "head", "house", "service", "friend", "father", "power", "hour", "game", "line", "end", "member", "law", "car", "city", "community", "name", "president", "team", "minute", "idea", "kid", "body", "information", "back", "parent", "face", "others", "level", "office", "door", "health", "person", "art", "war", "history", "party", "result", "change", "morning", "reason", "research", "girl", "guy", "moment", "air", "teacher", "force", "education", "river", "garden", "window", "market", "table", "road", "light", "music", "field", "paper", "village", "sea", "mountain", "small", "large", "old", "new", "good", "great", "long", "little", "own", "other", "right", "big", "high", "different", "early", "young", "important", "few", "public", "bad", "same", "able", "every", "open", "green", "quiet", "slow", "bright", "cold", "warm", "dark", "simple", "strong", "walk", "run", "read", "write", "speak", "build", "carry", "follow", "begin", "grow", "learn", "remember", "bring", "hold", "stand", "turn", "start", "show", "hear", "play", "move", "live", "believe", "happen", "include", "continue", "set", "lead", "understand", "watch", "stop", "create"]


# Words of a prompt whose KV fills two pool objects (256 tokens each) whatever ``--long-words``
# says: the rows about the pool need prompts the pool stores.
POOL_PROMPT_WORDS = 500


def long_prompt(seed: int, client: int, k: int, n_words: int) -> str:
    """Prompt ``k`` of client ``client``: ``n_words`` words that share no prefix with another."""
    rng = random.Random(f"{seed}/{client}/{k}")
    words = [rng.choice(_WORDS) for _ in range(n_words)]
    return f"Note {client}-{k}. " + " ".join(words) + ". Summarize the note:"


def proc_status(pid: int, names: Sequence[str]) -> dict[str, int]:
    """The numeric fields ``names`` of ``/proc/PID/status`` (memory in KiB); {} when it cannot be read."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    wanted = "|".join(map(re.escape, names))
    return {m.group(1): int(m.group(2)) for m in re.finditer(rf"^({wanted}):\s+(\d+)", text, re.MULTILINE)}


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of ``pid`` in KiB; {} when it cannot be read."""
    return proc_status(pid, ("VmRSS", "VmHWM"))


def open_fds(pid: int) -> list[str]:
    """What each open descriptor of ``pid`` names (``socket:[...]``, ``/memfd:NAME (deleted)``, a
    path); one that closes while it is read is left out."""
    targets = []
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    for fd in fds:
        try:
            targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return targets


# --------------------------------------------------------------------------- the long-prompt load


async def send_long(run: Run, prompt: str, key: str, stream: bool = False, base_url: str | None = None) -> Outcome:
    """One long prompt (``long_max_tokens``, greedy) to the cluster (or ``base_url``), counted
    with the run's outcomes under ``key``: every answer to the same key must be the same text."""
    out = Outcome(run.phase, -1, stream=stream, long_key=key)
    run.outcomes.append(out)
    body = {"prompt": prompt, "max_tokens": run.cfg.long_max_tokens, "temperature": 0, "stream": stream}
    return await send(run.client, base_url or run.cluster.url, out, run.cfg.long_max_tokens, run.cfg.deadline_s,
                      override=(COMPLETIONS, body))


async def long_clients(run: Run, stop: asyncio.Event) -> None:
    """``long_clients`` clients, each a new long prompt after the other, cold then warm."""

    async def client(c: int) -> None:
        k = 0
        while not stop.is_set():
            prompt = long_prompt(run.cfg.seed, c, k, run.cfg.long_words)
            for warm in (False, True):
                while not run.traffic.is_set() and not stop.is_set():  # paused (Run.paused_traffic)
                    await asyncio.sleep(0.2)
                if stop.is_set():
                    return
                out = await send_long(run, prompt, f"{c}.{k}", stream=(c + k + warm) % 2 == 1)
                if out.result != "completed":
                    await asyncio.sleep(1.0)  # an error answer is quick: do not spin
            k += 1

    await asyncio.gather(*(client(c) for c in range(run.cfg.long_clients)))


# --------------------------------------------------------------------------- the monitor


@dataclass
class Monitor:
    """What the Conductor said about its instances while the run went on."""

    samples: int = 0
    marked_down: list[dict[str, Any]] = field(default_factory=list)  # healthy instances marked down
    faulted_down: int = 0  # samples where the faulted instance was down (expected)
    rss_kib: list[tuple[float, int]] = field(default_factory=list)
    peak_hwm_kib: int = 0


async def monitor(run: Run, stop: asyncio.Event, interval_s: float = 0.5) -> None:

    m = run.monitor
    open_episodes: dict[str, dict[str, Any]] = {}
    pid = run.cluster.server.proc.pid
    while not stop.is_set():
        mem = memory_kib(pid)
        if mem:
            m.rss_kib.append((run._elapsed(), mem.get("VmRSS", 0)))
            m.peak_hwm_kib = max(m.peak_hwm_kib, mem.get("VmHWM", 0))
        stats = await conductor_stats(run.client, run.cluster)
        if stats:
            m.samples += 1
            for inst in stats.get("instances", []):
                url = inst["url"]
                if inst["up"]:
                    open_episodes.pop(url, None)
                elif url in run.faulted:
                    m.faulted_down += 1
                    open_episodes.pop(url, None)
                elif url not in open_episodes:
                    episode = {"url": url, "role": inst["role"], "phase": run.phase, "at_s": run._elapsed(),
                               "last_error": inst.get("last_error"), "faulted_then": sorted(run.faulted)}
                    open_episodes[url] = episode
                    m.marked_down.append(episode)
                    progress(f"HEALTHY instance marked down: {episode}")
                else:
                    open_episodes[url]["until_s"] = run._elapsed()
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
        except asyncio.TimeoutError:
            pass
