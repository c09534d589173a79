"""What stage 0 drops: counts by reason, a few origins per reason for the log and the manifest, and a capped
sample of the dropped documents themselves per reason (output_dir/dropped/<reason>.jsonl), so that a user can
read what a threshold removes before changing it."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path

EXAMPLES_PER_REASON = 3
SAMPLES_FOLDER = "dropped"


def sample_name(reason: str) -> str:
    """The sample file of a reason: its words and numbers, e.g. quality_duplicate_lines_0.3.jsonl."""
    return re.sub(r"[^A-Za-z0-9.]+", "_", reason).strip("_.") + ".jsonl"


class Drops:
    """Counts and examples of dropped documents; `samples` documents per reason appended to files in `folder`
    as they come (RAM stays flat however long the documents are)."""

    def __init__(self, folder: Path, samples: int) -> None:
        self.folder, self.samples = folder, samples
        self.counts: Counter[str] = Counter()
        self.examples: dict[str, list[str]] = {}
        self.written: Counter[str] = Counter()  # samples per file name

    def drop(self, reason: str, origin: str, text: str | None = None, **about: str) -> None:
        """Count one dropped document; `about` (e.g. which kept document it duplicates) goes into its example
        and its sample."""
        self.counts[reason] += 1
        examples = self.examples.setdefault(reason, [])
        if len(examples) < EXAMPLES_PER_REASON:
            examples.append(" ".join([origin, *(f"({key.replace('_', ' ')} {value})" for key, value in about.items())]))
        name = sample_name(reason)
        if text is None or self.written[name] >= self.samples:
            return
        self.written[name] += 1
        # backslashreplace: a lone surrogate (a dropped reason of its own) is still written, escaped
        with open(self.folder / name, "a", encoding="utf-8", errors="backslashreplace") as fh:
            fh.write(json.dumps({"reason": reason, "origin": origin, **about, "text": text}, ensure_ascii=False)
                     + "\n")

    def merge(self, counts: dict[str, int], examples: dict[str, list[str]], folder: Path,
              relocate: Callable[[str], str]) -> None:
        """Add one shard's drops after the earlier shards' (corpus/firstpass.py): its counts, its examples and
        the samples it wrote in `folder`, as far as the caps allow; `relocate` gives an origin its line number
        in the file."""
        for reason, n in counts.items():
            self.counts[reason] += n
            mine = self.examples.setdefault(reason, [])
            mine.extend(map(relocate, examples[reason][:EXAMPLES_PER_REASON - len(mine)]))
        for path in sorted(folder.glob("*.jsonl")):
            if self.written[path.name] >= self.samples:
                continue
            with (open(path, encoding="utf-8", errors="backslashreplace") as src,
                  open(self.folder / path.name, "a", encoding="utf-8", errors="backslashreplace") as dst):
                for line in src:
                    if self.written[path.name] >= self.samples:
                        break
                    sample = json.loads(line)
                    sample["origin"] = relocate(sample["origin"])
                    dst.write(json.dumps(sample, ensure_ascii=False) + "\n")
                    self.written[path.name] += 1

    def wants(self, reason: str) -> bool:
        """Whether one more document of `reason` would be kept as an example or a sample (worth reading it)."""
        return (len(self.examples.get(reason, ())) < EXAMPLES_PER_REASON
                or self.written[sample_name(reason)] < self.samples)

    def files(self) -> list[str]:
        """The sample files written, by name."""
        return sorted(self.written)
