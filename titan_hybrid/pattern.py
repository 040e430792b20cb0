"""Hybrid layer pattern grammar (Megatron's).

A pattern has one character per layer, one symbol per layer kind of the table
(titan_hybrid.model.layer_kinds):

    M  Mamba2          G  gated DeltaNet      *  self-attention
    +  MLA             D  DeepSeek sparse attention (DSA)
    -  dense MLP       E  mixture of experts

``|`` marks a pipeline-segment boundary in the main part, and each ``/`` starts
one multi-token-prediction (MTP) depth: ``"M*-|M*E/*-/*-"`` is a main stack of
two pipeline segments followed by two MTP depths of ``*-``. All MTP depths must
be identical; a single trailing ``/`` with nothing after it means zero depths.
``[...]`` bundles several physical layers into one logical layer (``"M[M*]-"``
has 3 logical and 4 physical layers); ``E`` may only close a group. Groups and
``|`` are not allowed in MTP depths. As in Megatron, self-attention ``*`` cannot share the main
part, or an MTP depth, with ``+`` or ``D`` (``LayerKind.excludes``); Megatron checks the main
part and the MTP pattern separately, so ``"M*-/+-"`` is allowed. A Megatron symbol that the
table lacks would be named as not supported. Every malformed pattern raises ``ValueError``
naming the offending character and its 0-based position in the full pattern.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_hybrid.model.layer_kinds import LAYER_KINDS

Item = str | tuple[str, ...]

SYMBOL_NAMES = {symbol: kind.name for symbol, kind in LAYER_KINDS.items()}
_MEGATRON_SYMBOLS = {"M": "Mamba", "G": "gated DeltaNet", "*": "attention", "-": "MLP",
                     "E": "MoE", "D": "DSA attention", "+": "MLA"}
_UNSUPPORTED = {symbol: title for symbol, title in _MEGATRON_SYMBOLS.items()
                if symbol not in LAYER_KINDS}
_GROUP_CLOSERS = {symbol for symbol, kind in LAYER_KINDS.items() if kind.closes_group}
_STRUCTURE = "[ ] | /"


def physical_symbols(item: Item) -> tuple[str, ...]:
    """The physical layer symbols of one logical item: 'M' -> ('M',)."""
    return (item,) if isinstance(item, str) else tuple(item)


def _error(pattern: str, rule: str) -> ValueError:
    return ValueError(f"hybrid pattern {pattern!r}: {rule}")


def _char_error(pattern: str, pos: int, rule: str) -> ValueError:
    return _error(pattern, f"{pattern[pos]!r} at position {pos} {rule}")


@dataclass(frozen=True)
class PipelineStage:
    """The layers of one pipeline stage; index = virtual_stage * pp_size + pp_rank.

    An empty stage keeps the indices of the layer that would come next.
    """

    index: int
    pp_rank: int
    virtual_stage: int
    items: list[Item]
    first_logical_index: int
    first_physical_index: int

    def __hash__(self) -> int:  # the list field would make the generated hash fail
        return hash((self.index, self.pp_rank, self.virtual_stage, tuple(self.items),
                     self.first_logical_index, self.first_physical_index))


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
        """Every physical layer's symbol in order; MTP layers once per depth if asked."""
        items = self.main + (self.mtp * self.mtp_depths if include_mtp else [])
        return [symbol for item in items for symbol in physical_symbols(item)]

    def pipeline_stages(self, pp_size: int,
                        num_virtual_stages: int | None = None) -> list[PipelineStage]:
        """Split the main layers into pp_size * num_virtual_stages stages.

        With '|' separators segment s becomes stage s; without them the physical
        layers are split evenly, which must not cut through a group.
        """
        if pp_size < 1:
            raise ValueError(f"pp_size must be >= 1, got {pp_size}")
        if num_virtual_stages is not None and num_virtual_stages < 1:
            raise ValueError(f"num_virtual_stages must be >= 1, got {num_virtual_stages}")
        if len(self.segments) > 1:
            chunks = self._explicit_chunks(pp_size, num_virtual_stages)
        else:
            chunks = self._even_chunks(pp_size * (num_virtual_stages or 1))
        stages, logical, physical = [], 0, 0
        for index, items in enumerate(chunks):
            stages.append(PipelineStage(
                index=index, pp_rank=index % pp_size, virtual_stage=index // pp_size,
                items=list(items), first_logical_index=logical,
                first_physical_index=physical))
            logical += len(items)
            physical += sum(len(physical_symbols(item)) for item in items)
        return stages

    def _explicit_chunks(self, pp_size: int,
                         num_virtual_stages: int | None) -> list[list[Item]]:
        count = len(self.segments)
        if count % pp_size:
            raise _error(self.text, f"{count} pipeline segments cannot be divided among "
                         f"pp_size={pp_size} ranks; with '|' separators the number of "
                         "segments must be divisible by pp_size")
        implied = count // pp_size
        if num_virtual_stages is not None and num_virtual_stages != implied:
            raise _error(self.text, f"num_virtual_stages={num_virtual_stages} does not "
                         f"match the {count} segments / pp_size={pp_size} = {implied} "
                         "virtual stages set by the '|' separators")
        return self.segments

    def _even_chunks(self, num_stages: int) -> list[list[Item]]:
        total = self.num_physical_layers
        if total % num_stages:
            raise _error(self.text, f"{total} physical layers cannot be split evenly into "
                         f"{num_stages} pipeline stages; the layer count must be "
                         "divisible by pp_size * num_virtual_stages, or place '|' "
                         "separators to choose the split explicitly")
        per_stage = total // num_stages
        chunks, current, filled = [], [], 0
        for item, pos in zip(self.main, _main_item_positions(self.text)):
            size = len(physical_symbols(item))
            # Only a group can overshoot, since filled < per_stage here.
            if filled + size > per_stage:
                raise _char_error(self.text, pos, f"opens a group that an even split into "
                                  f"{num_stages} stages of {per_stage} physical layers "
                                  "would cut through; place '|' separators explicitly")
            current.append(item)
            filled += size
            if filled == per_stage:
                chunks.append(current)
                current, filled = [], 0
        return chunks


def _main_item_positions(text: str) -> list[int]:
    """Pattern position of each main item (a group counts at its '[')."""
    positions, in_group = [], False
    for pos, ch in enumerate(text):
        if ch == "/":
            break
        if ch == "[":
            positions.append(pos)
            in_group = True
        elif ch == "]":
            in_group = False
        elif ch in SYMBOL_NAMES and not in_group:
            positions.append(pos)
    return positions


def _scan(pattern: str) -> tuple[list[list[Item]], list[tuple[int, list[Item]]]]:
    """One left-to-right pass: main segments and (slash position, items) per MTP part."""
    segments: list[list[Item]] = [[]]
    mtp_parts: list[tuple[int, list[Item]]] = []
    target = segments[0]
    group_start: int | None = None
    group: list[str] = []
    for pos, ch in enumerate(pattern):
        in_mtp = bool(mtp_parts)
        if ch in _UNSUPPORTED:
            raise _char_error(pattern, pos, f"({_UNSUPPORTED[ch]}) is not supported")
        if ch in SYMBOL_NAMES:
            if group_start is None:
                target.append(ch)
                continue
            if group and group[-1] in _GROUP_CLOSERS:  # inside a group only symbols precede
                raise _char_error(pattern, pos - 1, "must be the last symbol of a group")
            group.append(ch)
        elif ch == "[":
            if in_mtp:
                raise _char_error(pattern, pos, "opens a group in an MTP depth; groups "
                                  "are not allowed in MTP")
            if group_start is not None:
                raise _char_error(pattern, pos, "opens a nested group inside the group "
                                  f"at position {group_start}; groups cannot be nested")
            group_start, group = pos, []
        elif ch == "]":
            if group_start is None:
                raise _char_error(pattern, pos, "is a stray ']' with no open group")
            if not group:
                raise _char_error(pattern, pos, "closes an empty group; a group needs "
                                  "at least one symbol")
            target.append(tuple(group))
            group_start = None
        elif ch == "|":
            if in_mtp:
                raise _char_error(pattern, pos, "is not allowed in an MTP depth; '|' "
                                  "only separates pipeline segments of the main part")
            if group_start is not None:
                raise _char_error(pattern, pos, "is not allowed inside a group (opened "
                                  f"at position {group_start})")
            target = []
            segments.append(target)
        elif ch == "/":
            if group_start is not None:
                raise _char_error(pattern, group_start, "opens an unmatched group: it is "
                                  f"not closed before '/' at position {pos}")
            target = []
            mtp_parts.append((pos, target))
        elif ch.isspace():
            raise _char_error(pattern, pos, "is whitespace, which is not allowed")
        else:
            raise _char_error(pattern, pos, "is not a known symbol; expected one of "
                              f"{' '.join(LAYER_KINDS)} {_STRUCTURE}")
    if group_start is not None:
        raise _char_error(pattern, group_start, "opens an unmatched group: it is never closed")
    return segments, mtp_parts


def _mtp_depth(pattern: str, parts: list[tuple[int, list[Item]]]) -> tuple[list[Item], int]:
    """The items of one MTP depth and the depth count."""
    if not parts or (len(parts) == 1 and not parts[0][1]):
        return [], 0  # no '/' at all, or a single trailing '/'
    for pos, items in parts:
        if not items:
            raise _char_error(pattern, pos, "starts an empty MTP depth; only a single "
                              "trailing '/' may be empty (meaning zero depths)")
    first = parts[0][1]
    for pos, items in parts[1:]:
        if items != first:
            raise _char_error(pattern, pos, f"starts MTP depth {''.join(items)!r}, which "
                              f"differs from the first depth {''.join(first)!r}; all MTP "
                              "depths must be identical")
    return list(first), len(parts)


def _check_exclusions(pattern: str) -> None:
    """Kinds that may not share a part (main, or the MTP depths) with some other symbol."""
    for start, end in _parts(pattern):
        first_at = {}
        for pos in range(start, end):
            first_at.setdefault(pattern[pos], pos)
        for symbol, pos in first_at.items():
            kind = LAYER_KINDS.get(symbol)
            for other in (kind.excludes if kind else ()):
                if other in first_at:
                    part = "the main part" if start == 0 else "an MTP depth"
                    raise _char_error(
                        pattern, pos, f"cannot share {part} with {other!r} at position "
                        f"{first_at[other]}: {LAYER_KINDS[other].title} and {kind.title} may not "
                        "be mixed (Megatron: \"Not supported to have both Attention and "
                        "MLA/DSA in one model\")")


def _parts(pattern: str) -> list[tuple[int, int]]:
    """(start, end) of the main part and of the MTP part (all depths, identical)."""
    slash = pattern.find("/")
    return [(0, len(pattern))] if slash < 0 else [(0, slash), (slash, len(pattern))]


def parse_hybrid_pattern(pattern: str) -> HybridPattern:
    """Parse and validate a hybrid layer pattern such as "M*M-E|M[M*]E/*-"."""
    if not isinstance(pattern, str):
        raise TypeError(f"hybrid pattern must be a str, got {type(pattern).__name__}")
    segments, mtp_parts = _scan(pattern)
    main = [item for segment in segments for item in segment]
    if not main:
        where = f" (before '/' at position {mtp_parts[0][0]})" if mtp_parts else ""
        raise _error(pattern, f"the main part{where} has no layers; it must contain at "
                     "least one layer")
    mtp, depths = _mtp_depth(pattern, mtp_parts)
    _check_exclusions(pattern)
    return HybridPattern(text=pattern, main=main, mtp=mtp, mtp_depths=depths,
                         segments=segments)
