"""Hybrid layer pattern grammar (Megatron's).

A pattern has one character per layer, one symbol per layer kind of the table
(titan_hybrid.model.symbols, which imports no layer code):

    M  Mamba2          G  gated DeltaNet      *  self-attention
    K  Kimi delta attention (KDA)              S  gated short convolution (LFM2)
    +  MLA             D  DeepSeek sparse attention (DSA)
    W  DeepSeek-V4 sliding-window attention     H  DeepSeek-V4 heavily compressed attention
    C  DeepSeek-V4 compressed sparse attention
    -  dense MLP       E  mixture of experts

``|`` marks a pipeline-segment boundary in the main part, and each ``/`` starts
one multi-token-prediction (MTP) depth: ``"M*-|M*E/*-/*-"`` is a main stack of
two pipeline segments followed by two MTP depths of ``*-``. All MTP depths must
be identical; a single trailing ``/`` with nothing after it means zero depths.
``[...]`` bundles several physical layers into one logical layer (``"M[M*]-"``
has 3 logical and 4 physical layers); ``E`` may only close a group. Groups and
``|`` are not allowed in MTP depths. Two rules of Megatron's (its head, which checks the
main part and the MTP depths as one string):

- self-attention ``*`` and the MLA family (``MLA_FAMILY``: ``+``, ``D``, ``C``, ``H``, ``W``) may
  not both appear in one model, so ``"M*-/+-"`` is refused as well as ``"M*-+"``;
- a group holds at most one layer of each checkpoint namespace (``LayerSymbol.namespace``:
  mixer ``M``; self_attention ``G * + D C H W``; mlp ``- E``), so ``[MM]``, ``[*G]`` and ``[-E]``
  are refused.

``(...)`` is a parallel group (not in Megatron's grammar; Falcon-H1's layers, Megatron-Bridge's
ParallelHybridLayer): ONE physical layer whose members read the same normed input, their
outputs summed into the residual stream, ``"(M*)-"`` for Falcon-H1. Its members hold distinct
checkpoint namespaces, so at most one mixer, one attention-like layer and one MLP (``(*-)`` is
PaLM's parallel block); ``E`` may not be a member; a group needs two members; it may stand in
a bracket group (``"[(M*)-]"``), whose namespace rule then counts its members, but not in an
MTP depth. Such a physical layer's symbol is the string of its members (``"M*"``:
``members``).

Every malformed pattern raises ``ValueError`` naming the offending character and its 0-based
position in the full pattern.
Pipeline stages are cut from a parsed pattern in titan_hybrid.parallel.pipeline_split.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_hybrid.model.symbols import MLA_FAMILY, SELF_ATTENTION_SYMBOL, SYMBOLS

# A logical layer: a physical layer's symbol (one character, or a parallel group's members,
# "M*"), or a bracket group's tuple of them.
Item = str | tuple[str, ...]

_STRUCTURE = "[ ] ( ) | /"


def physical_symbols(item: Item) -> tuple[str, ...]:
    """The physical layer symbols of one logical item: 'M' -> ('M',)."""
    return (item,) if isinstance(item, str) else tuple(item)


def members(symbol: str) -> tuple[str, ...]:
    """The layer kinds' symbols of one physical layer: 'M' -> ('M',), a parallel group's 'M*'
    -> ('M', '*')."""
    return tuple(symbol)


def written(symbol: str) -> str:
    """A physical layer as the pattern writes it: 'M', or '(M*)'."""
    return symbol if len(symbol) == 1 else f"({symbol})"


def pattern_error(pattern: str, rule: str) -> ValueError:
    return ValueError(f"hybrid pattern {pattern!r}: {rule}")


def char_error(pattern: str, pos: int, rule: str) -> ValueError:
    """The error for the character at `pos`, named with its 0-based position."""
    return pattern_error(pattern, f"{pattern[pos]!r} at position {pos} {rule}")


@dataclass(frozen=True)
class HybridPattern:
    """A parsed pattern; build it with parse_hybrid_pattern."""

    text: str
    main: list[Item]
    mtp: list[Item]
    mtp_depths: int
    segments: list[list[Item]]

    def __hash__(self) -> int:  # everything else is derived from the text
        return hash(self.text)

    @property
    def num_logical_layers(self) -> int:
        return len(self.main)

    @property
    def num_physical_layers(self) -> int:
        return sum(len(physical_symbols(item)) for item in self.main)

    def physical_layer_symbols(self, *, include_mtp: bool = False) -> list[str]:
        """Every physical layer's symbol in order (a parallel group's: its members, "M*");
        MTP layers once per depth if asked."""
        items = self.main + (self.mtp * self.mtp_depths if include_mtp else [])
        return [symbol for item in items for symbol in physical_symbols(item)]

    def member_symbols(self, *, include_mtp: bool = False) -> set[str]:
        """The symbols of every layer kind the pattern holds, parallel groups' members
        included."""
        return {member for symbol in self.physical_layer_symbols(include_mtp=include_mtp)
                for member in members(symbol)}


def _scan(pattern: str) -> tuple[list[list[Item]], list[tuple[int, list[Item]]]]:
    """One left-to-right pass: main segments and (slash position, items) per MTP part."""
    segments: list[list[Item]] = [[]]
    mtp_parts: list[tuple[int, list[Item]]] = []
    target = segments[0]
    group_start: int | None = None
    group: list[str] = []
    parallel_start: int | None = None
    for pos, ch in enumerate(pattern):
        in_mtp = bool(mtp_parts)
        if ch in SYMBOLS and parallel_start is not None:
            if SYMBOLS[ch].closes_group:
                raise char_error(pattern, pos, "may not be a member of a parallel group")
            _check_namespace(pattern, parallel_start if group_start is None else group_start,
                             pos)
        elif ch in SYMBOLS:
            if group_start is None:
                target.append(ch)
                continue
            if group and SYMBOLS[group[-1][-1]].closes_group:  # in a group only symbols precede
                raise char_error(pattern, pos - 1, "must be the last symbol of a group")
            _check_namespace(pattern, group_start, pos)
            group.append(ch)
        elif ch == "(":
            if in_mtp:
                raise char_error(pattern, pos, "opens a parallel group in an MTP depth; "
                                  "parallel groups are not allowed in MTP")
            if parallel_start is not None:
                raise char_error(pattern, pos, "opens a parallel group inside the parallel "
                                  f"group at position {parallel_start}; they cannot be nested")
            if group and SYMBOLS[group[-1][-1]].closes_group:
                raise char_error(pattern, pos - 1, "must be the last symbol of a group")
            parallel_start = pos
        elif ch == ")":
            if parallel_start is None:
                raise char_error(pattern, pos, "is a stray ')' with no open parallel group")
            parallel = pattern[parallel_start + 1:pos]
            if len(parallel) < 2:
                raise char_error(pattern, parallel_start, "opens a parallel group of "
                                  f"{len(parallel)} layer(s); a parallel group needs at least two")
            (target if group_start is None else group).append(parallel)
            parallel_start = None
        elif parallel_start is not None:
            raise char_error(pattern, pos, "is not allowed inside a parallel group (opened at "
                              f"position {parallel_start}), which holds layer symbols only")
        elif ch == "[":
            if in_mtp:
                raise char_error(pattern, pos, "opens a group in an MTP depth; groups "
                                  "are not allowed in MTP")
            if group_start is not None:
                raise char_error(pattern, pos, "opens a nested group inside the group "
                                  f"at position {group_start}; groups cannot be nested")
            group_start, group = pos, []
        elif ch == "]":
            if group_start is None:
                raise char_error(pattern, pos, "is a stray ']' with no open group")
            if not group:
                raise char_error(pattern, pos, "closes an empty group; a group needs "
                                  "at least one symbol")
            target.append(tuple(group))
            group_start = None
        elif ch == "|":
            if in_mtp:
                raise char_error(pattern, pos, "is not allowed in an MTP depth; '|' "
                                  "only separates pipeline segments of the main part")
            if group_start is not None:
                raise char_error(pattern, pos, "is not allowed inside a group (opened "
                                  f"at position {group_start})")
            target = []
            segments.append(target)
        elif ch == "/":
            if group_start is not None:
                raise char_error(pattern, group_start, "opens an unmatched group: it is "
                                  f"not closed before '/' at position {pos}")
            target = []
            mtp_parts.append((pos, target))
        elif ch.isspace():
            raise char_error(pattern, pos, "is whitespace, which is not allowed")
        else:
            raise char_error(pattern, pos, "is not a known symbol; expected one of "
                              f"{' '.join(SYMBOLS)} {_STRUCTURE}")
    if parallel_start is not None:
        raise char_error(pattern, parallel_start, "opens an unmatched parallel group: it is "
                         "never closed")
    if group_start is not None:
        raise char_error(pattern, group_start, "opens an unmatched group: it is never closed")
    return segments, mtp_parts


def _mtp_depth(pattern: str, parts: list[tuple[int, list[Item]]]) -> tuple[list[Item], int]:
    """The items of one MTP depth and the depth count."""
    if not parts or (len(parts) == 1 and not parts[0][1]):
        return [], 0  # no '/' at all, or a single trailing '/'
    for pos, items in parts:
        if not items:
            raise char_error(pattern, pos, "starts an empty MTP depth; only a single "
                              "trailing '/' may be empty (meaning zero depths)")
    first = parts[0][1]
    for pos, items in parts[1:]:
        if items != first:
            raise char_error(pattern, pos, f"starts MTP depth {''.join(items)!r}, which "
                              f"differs from the first depth {''.join(first)!r}; all MTP "
                              "depths must be identical")
    return list(first), len(parts)


def _check_namespace(pattern: str, group_start: int, pos: int) -> None:
    """The symbol at `pos` may not join its group (a bracket or parallel group, opened at
    `group_start`) if a layer of its checkpoint namespace is in it already."""
    namespace = SYMBOLS[pattern[pos]].namespace
    close_char = "]" if pattern[group_start] == "[" else ")"
    for before in range(group_start + 1, pos):
        if pattern[before] in SYMBOLS and SYMBOLS[pattern[before]].namespace == namespace:
            close = pattern.find(close_char, pos)
            group = pattern[group_start:len(pattern) if close < 0 else close + 1]
            rule = ("a parallel group's members hold distinct namespaces" if close_char == ")"
                    else "a layer group holds at most one layer of each namespace (Megatron: "
                    f"\"Layer group '{group}' contains multiple layers in checkpoint "
                    f"namespace '{namespace}'\")")
            raise char_error(
                pattern, pos, f"joins {pattern[before]!r} at position {before} in checkpoint "
                f"namespace '{namespace}': {rule}")


def _check_attention_families(pattern: str) -> None:
    """Self-attention and the MLA family may not share a model (main part and MTP depths)."""
    attention = pattern.find(SELF_ATTENTION_SYMBOL)
    latent = min((pattern.find(symbol) for symbol in MLA_FAMILY if symbol in pattern),
                 default=-1)
    if attention >= 0 and latent >= 0:
        raise char_error(
            pattern, latent, f"cannot share a model with {SELF_ATTENTION_SYMBOL!r} at position "
            f"{attention}: self-attention and the MLA family ({' '.join(MLA_FAMILY)}) may not "
            "be mixed, in the main part and the MTP depths alike (Megatron: \"Not supported "
            "to have both Attention and MLA/DSA/CSA/HCA/Window in one model\")")


def parse_hybrid_pattern(pattern: str) -> HybridPattern:
    """Parse and validate a hybrid layer pattern such as "M*M-E|M[M*]E/*-"."""
    if not isinstance(pattern, str):
        raise TypeError(f"hybrid pattern must be a str, got {type(pattern).__name__}")
    segments, mtp_parts = _scan(pattern)
    main = [item for segment in segments for item in segment]
    if not main:
        where = f" (before '/' at position {mtp_parts[0][0]})" if mtp_parts else ""
        raise pattern_error(pattern, f"the main part{where} has no layers; it must contain at "
                     "least one layer")
    mtp, depths = _mtp_depth(pattern, mtp_parts)
    _check_attention_families(pattern)
    return HybridPattern(text=pattern, main=main, mtp=mtp, mtp_depths=depths,
                         segments=segments)
