"""Choosing ``max_length``: the token rule and the sequence rule side by side, and a default that holds up.

Two rules, each the smallest multiple of ``multiple_of`` that meets a share:

- **sequence rule** (``keep_sequences``): at least that share of the sequences fits whole.  With
  ``bfd_split`` no token is dropped at any length (the longer sequences are cut into ``max_length`` chunks),
  so this rule only decides how many sequences are cut.
- **token rule** (``keep_tokens``): ``bfd`` (which truncates) keeps at least that share of the tokens.  On
  long-tailed data a few huge sequences hold much of the token mass, and this rule asks for a huge
  ``max_length`` (the figures: docs/profiling.md).

The default (neither share given) is the **sequence rule at 0.99**, packed with ``bfd_split``: it keeps
>= 99% of the sequences whole and every token, whatever the tail.  Either way the :class:`Recommendation`
carries both rules with what each costs (sequences cut, tokens ``bfd`` drops, packed rows, attention cost
from the real planner), and a flag for any value above ``max_context`` (default :data:`COMMON_CONTEXT`, the
largest context most fine-tuning runs train with): such a value is never offered without saying so.

>>> from packtools.profiling import LengthProfile
>>> p = LengthProfile([100] * 990 + [50_000] * 10)
>>> sequence_rule(p, 0.99, 64), token_rule(p, 0.99, 64)
(128, 49408)
>>> rec = p.recommend()
>>> rec.max_length, rec.strategy, [o.max_length for o in rec.options], len(rec.flags)
(128, 'bfd_split', [128, 49408], 1)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from .._format import text_table
from ..errors import PackingError
from .distribution import LengthDistribution
from .tradeoffs import tradeoff_row

DEFAULT_KEEP_SEQUENCES = 0.99
DEFAULT_KEEP_TOKENS = 0.99
#: Above this a recommended ``max_length`` is flagged (32k: the longest context most fine-tuning runs use;
#: attention memory and time per row grow with it).
COMMON_CONTEXT = 32768


@dataclass(frozen=True)
class RuleOption:
    """One rule's ``max_length`` and its costs (shares are fractions of all sequences / tokens)."""

    rule: str  # "sequences" | "tokens"
    share: float
    strategy: str  # the strategy the rule is meant for
    max_length: int
    sequences_cut: int
    tokens_dropped_bfd: int
    bfd_rows: int
    bfd_split_rows: int
    attention: float  # attention cost of `strategy`, relative to every sequence whole (see tradeoffs)
    above_context: bool
    trained: bool = False  # the token rule counted trained (label) tokens

    @property
    def label(self) -> str:
        return (
            f"sequences whole >= {self.share:.1%} ({self.strategy})"
            if self.rule == "sequences"
            else f"{'trained ' if self.trained else ''}tokens kept by bfd >= {self.share:.1%}"
        )


@dataclass(frozen=True, eq=False)
class Recommendation:
    """A ``max_length`` and why: ``str(rec)`` is the reason in words; ``options`` holds both rules with their
    costs, ``flags`` what the user should know before training with it (e.g. above a common context size)."""

    max_length: int
    reason: str
    keep_tokens: float | None
    tokens_kept_share: float
    truncated_share: float
    keep_sequences: float | None = None
    rule: str = "tokens"
    strategy: str = "bfd"
    options: tuple[RuleOption, ...] = ()
    flags: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.reason

    def to_text(self) -> str:
        """The reason, both rules side by side, and the flags (what ``packtools profile`` prints)."""
        lines = [f"recommended: {self.reason}"]
        if self.options:
            rows = [
                [
                    ("* " if o.rule == self.rule else "  ") + o.label,
                    f"{o.max_length:,}",
                    f"{o.sequences_cut:,}",
                    f"{o.tokens_dropped_bfd:,}",
                    f"{o.bfd_rows:,}",
                    f"{o.bfd_split_rows:,}",
                    f"{o.attention:.3g}x ({o.strategy})",
                ]
                for o in self.options
            ]
            head = [
                "rule",
                "max_length",
                "seqs cut",
                "bfd drops (tokens)",
                "rows bfd",
                "rows bfd_split",
                "attention",
            ]
            lines += ["", "both rules (* = recommended):", text_table([head, *rows])]
        lines += [f"note: {f}" for f in self.flags]
        return "\n".join(lines)


def _check_share(value: object, name: str, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise PackingError(f"{name}={value!r} must be a share of {what} in (0, 1], e.g. 0.99.", param=name)
    return float(value)


def token_rule(profile: LengthDistribution, keep_tokens: float, multiple_of: int) -> int:
    """The smallest multiple of ``multiple_of`` at which ``bfd`` keeps at least ``keep_tokens`` of the tokens
    (of the trained tokens, for data with labels: what training learns from)."""
    trained = getattr(profile, "trained", None)
    if trained is not None and trained.total:
        total, kept_at = trained.total, trained.kept_by_bfd
    else:
        total, kept_at = profile.total_tokens, profile.tokens_kept
    need = math.ceil(Fraction(str(keep_tokens)) * total)
    lo, hi = 1, max(1, -(-profile.max // multiple_of))
    while lo < hi:
        mid = (lo + hi) // 2
        if kept_at(mid * multiple_of) >= need:
            hi = mid
        else:
            lo = mid + 1
    return lo * multiple_of


def sequence_rule(profile: LengthDistribution, keep_sequences: float, multiple_of: int) -> int:
    """The smallest multiple of ``multiple_of`` that holds at least ``keep_sequences`` of the sequences whole.

    Empty sequences are not counted: ``pack`` drops them (nothing to pack), so they must not make up a share.

    >>> from packtools.profiling import LengthProfile
    >>> sequence_rule(LengthProfile([0] * 50 + [10] * 49 + [1000]), 0.99, 64)
    1024
    """
    real = profile.count - profile.empty
    need = max(1, math.ceil(Fraction(str(keep_sequences)) * real) + profile.empty)
    longest = int(profile._values[np.searchsorted(profile._cum_rows, need, side="left") - 1])
    return max(1, -(-longest // multiple_of)) * multiple_of


def _option(profile: LengthDistribution, rule: str, share: float, m: int, max_context: int) -> RuleOption:
    row = tradeoff_row(profile, m, 8)
    whole = getattr(profile, "pairs", False) or getattr(profile, "whole", False)  # packed whole: bfd only
    strategy = "bfd_split" if rule == "sequences" and not whole else "bfd"
    return RuleOption(
        rule,
        share,
        strategy,
        m,
        profile.num_truncated(m),
        profile.total_tokens - profile.tokens_kept(m),
        row.bfd_rows,
        row.bfd_split_rows,
        row.attn_bfd_split if strategy == "bfd_split" else row.attn_bfd,
        m > max_context,
        getattr(profile, "trained", None) is not None,
    )


def recommend(
    profile: LengthDistribution,
    keep_tokens: float | None = None,
    multiple_of: int = 64,
    *,
    keep_sequences: float | None = None,
    max_context: int = COMMON_CONTEXT,
) -> Recommendation:
    """See the module docstring and :meth:`packtools.profiling.LengthProfile.recommend`."""
    if keep_tokens is not None and keep_sequences is not None:
        raise PackingError(
            "give keep_tokens or keep_sequences, not both: they are two rules (see LengthProfile.recommend).",
            param="keep_sequences",
        )
    for name, value, example in (("multiple_of", multiple_of, 64), ("max_context", max_context, 32768)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise PackingError(f"{name}={value!r} must be a positive int, e.g. {example}.", param=name)
    multiple_of, max_context = int(multiple_of), int(max_context)
    whole = getattr(profile, "whole", False)  # vision samples: packed whole, a longer one refused
    if whole and (keep_tokens is not None or (keep_sequences is not None and keep_sequences != 1.0)):
        given = "keep_tokens" if keep_tokens is not None else "keep_sequences"
        raise PackingError(
            f"{given}={keep_tokens if keep_tokens is not None else keep_sequences!r}: these samples (vision) are "
            f"packed whole and `pack --processor` / pack_dataset(..., processor=DIR) refuse a sample longer than "
            f"max_length, so the recommendation must hold every sample; call recommend() without {given} (it "
            f"holds every sample, keep_sequences=1.0).",
            param=given,
        )
    if whole:
        keep_sequences = 1.0
    rule = "tokens" if keep_tokens is not None else "sequences"
    kt = _check_share(DEFAULT_KEEP_TOKENS if keep_tokens is None else keep_tokens, "keep_tokens", "tokens")
    ks = _check_share(
        DEFAULT_KEEP_SEQUENCES if keep_sequences is None else keep_sequences, "keep_sequences", "sequences"
    )
    pairs = getattr(profile, "pairs", False)  # preference pairs: packed whole, by bfd only
    strategy = "bfd" if rule == "tokens" or pairs or whole else "bfd_split"
    if profile.total_tokens == 0:
        return Recommendation(
            multiple_of,
            "the dataset holds no tokens; any max_length keeps everything.",
            kt if rule == "tokens" else None,
            1.0,
            0.0,
            ks if rule == "sequences" else None,
            rule,
            strategy,
        )
    seq = _option(profile, "sequences", ks, sequence_rule(profile, ks, multiple_of), max_context)
    tok = _option(profile, "tokens", kt, token_rule(profile, kt, multiple_of), max_context)
    chosen = seq if rule == "sequences" else tok
    m, total, n = chosen.max_length, profile.total_tokens, profile.count
    kept = total - chosen.tokens_dropped_bfd
    cut = chosen.sequences_cut
    trained = getattr(profile, "trained", None)
    if rule == "sequences":
        real = n - profile.empty  # the sequences pack packs (it drops empty ones)
        reason = (
            f"max_length={m} is the smallest multiple of {multiple_of} that holds at least {ks:.1%} of the "
            f"sequences whole: {real - cut:,} of {real:,} fit ({(real - cut) / real:.2%})."
        )
        if profile.empty:
            reason += f" The {profile.empty:,} empty sequences are not counted (pack drops them)."
        if cut and pairs:
            reason += (
                f" Pack with strategy bfd (a preference pair is packed whole, never split): the other {cut:,} pairs "
                f"are truncated (--overlong truncate, the default; {kept / total:.2%} of the tokens kept) or dropped "
                f"(--overlong drop); the longest pair has {profile.max:,} tokens."
            )
        elif cut:
            reason += (
                f" Pack with strategy bfd_split: bfd_split cuts the other {cut:,} into max_length chunks and keeps "
                f"every token; bfd would keep {kept / total:.2%} of the tokens (the longest sequence has {profile.max:,})."
            )
        elif pairs:
            reason += " Every pair fits whole; pack with strategy bfd."
        elif whole:
            reason += (
                " Samples are packed whole (bfd) and a longer one is refused, so the recommendation holds every "
                "sample."
            )
        else:
            reason += " Every sequence fits, so bfd and bfd_split are identical."
        if trained is not None and trained.total and cut:
            _, idle = trained.idle_under_bfd(m)
            reason += (
                f" Of the trained (label) tokens, bfd would keep {trained.kept_by_bfd(m) / trained.total:.2%} and "
                f"spend {idle / max(kept, 1):.2%} of its tokens on sequences that train nothing; bfd_split (packtools "
                f"pack) cuts at turn ends and keeps every trained token."
            )
    elif trained is not None and trained.total:
        t_kept = trained.kept_by_bfd(m)
        reason = (
            f"max_length={m} is the smallest multiple of {multiple_of} at which bfd keeps at least {kt:.1%} of "
            f"the trained (label) tokens: it keeps {t_kept / trained.total:.2%} of them ({t_kept:,} of "
            f"{trained.total:,}), {kept / total:.2%} of all tokens, and truncates {cut:,} of {n:,} sequences "
            f"({cut / n:.2%})."
        )
    else:
        reason = (
            f"max_length={m} is the smallest multiple of {multiple_of} at which bfd keeps at least {kt:.1%} of "
            f"the tokens: it keeps {kept / total:.2%} ({total - kept:,} of {total:,} dropped) and truncates "
            f"{cut:,} of {n:,} sequences ({cut / n:.2%})."
        )
        if m > multiple_of:
            below = profile.tokens_kept(m - multiple_of)
            need = math.ceil(Fraction(str(kt)) * total)
            reason += f" {m - multiple_of} would keep {below:,} tokens, {need - below:,} short of the {need:,} needed."
        if cut:
            reason += (
                f" The longest sequence has {profile.max:,} tokens; to keep every token at this length use "
                f"strategy bfd_split, or filter the over-long sequences out."
            )
        else:
            reason += f" Every sequence fits (the longest has {profile.max:,} tokens), so bfd and bfd_split are identical."
    flags = []
    for o in (seq, tok):
        if o.above_context:
            which = "the recommended value" if o is chosen else f"the {o.rule[:-1]} rule's value"
            flags.append(
                f"{which} max_length={o.max_length:,} is above {max_context:,}, larger than the context most "
                f"fine-tuning runs use (attention memory and time per row grow with it); train with it only if "
                f"your model and memory allow, else choose a smaller --max-length"
                + (
                    " (over-long pairs are truncated or dropped)."
                    if pairs
                    else " (bfd_split keeps every token)."
                )
            )
    if rule == "tokens" and tok.max_length > 2 * seq.max_length:
        flags.append(
            f"the token rule asks for {tok.max_length / seq.max_length:.1f}x the length the sequence rule needs "
            f"({seq.max_length:,} holds {ks:.0%} of the sequences whole): a long tail holds the tokens; the sequence "
            f"rule{'' if pairs else ' with bfd_split'} is the default for this reason."
        )
    return Recommendation(
        m,
        reason,
        kt if rule == "tokens" else None,
        kept / total,
        cut / n,
        ks if rule == "sequences" else None,
        rule,
        strategy,
        (seq, tok),
        tuple(flags),
    )
