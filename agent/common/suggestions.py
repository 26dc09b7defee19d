""""Did you mean": the closest known names to a mistyped one, for the errors that name an unknown flag,
subcommand or configuration key."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

MAX_SUGGESTIONS = 3
CUTOFF = 0.6  # difflib's similarity ratio: "sample_intervl" ~ "sample_interval", "gpus" ~ "gpu"
NEARLY_AS_CLOSE = 0.1  # further names are suggested only when about as close as the best


def close_matches(word: str, known: Iterable[str]) -> list[str]:
    """The known names closest to ``word``, the closest first (none when nothing is close): the best,
    and those about as close, not every name past the cutoff."""
    matches = difflib.get_close_matches(word, sorted(set(known)), n=MAX_SUGGESTIONS, cutoff=CUTOFF)
    ratios = [difflib.SequenceMatcher(None, word, m).ratio() for m in matches]
    return [m for m, r in zip(matches, ratios, strict=True) if r >= ratios[0] - NEARLY_AS_CLOSE]


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """' (did you mean X?)', ' (did you mean X or Y?)', or '' when nothing known is close."""
    matches = close_matches(word, known)
    if not matches:
        return ""
    listed = matches[0] if len(matches) == 1 else f"{', '.join(matches[:-1])} or {matches[-1]}"
    return f" (did you mean {listed}?)"
