"""Pipeline stages of a hybrid pattern: which main-part layers each stage runs.

With `|` separators segment s becomes stage s; without them the physical layers are split
evenly, never through a bracket group. Stage `index = virtual_stage * pp_size + pp_rank`.
`module_names_per_stage` turns them into the model's module names that each stage keeps, and
`stages_per_rank` reads the virtual stages per rank from the pattern and the schedule;
parallel/pipeline.py builds torch's pipeline stages from them.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    ScheduleDualPipeV,
    ScheduleZBVZeroBubble,
    get_schedule_class,
)

from titan_hybrid.config.sections import ParallelismSection
from titan_hybrid.model.args import HybridModelArgs
from titan_hybrid.model.pattern import (
    HybridPattern,
    Item,
    char_error,
    pattern_error,
    physical_symbols,
)


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


def pipeline_stages(pattern: HybridPattern, pp_size: int,
                    num_virtual_stages: int | None = None) -> list[PipelineStage]:
    """Split the pattern's main layers into pp_size * num_virtual_stages stages."""
    if pp_size < 1:
        raise ValueError(f"pp_size must be >= 1, got {pp_size}")
    if num_virtual_stages is not None and num_virtual_stages < 1:
        raise ValueError(f"num_virtual_stages must be >= 1, got {num_virtual_stages}")
    if len(pattern.segments) > 1:
        chunks = _explicit_chunks(pattern, pp_size, num_virtual_stages)
    else:
        chunks = _even_chunks(pattern, pp_size * (num_virtual_stages or 1))
    stages, logical, physical = [], 0, 0
    for index, items in enumerate(chunks):
        stages.append(PipelineStage(
            index=index, pp_rank=index % pp_size, virtual_stage=index // pp_size,
            items=list(items), first_logical_index=logical, first_physical_index=physical))
        logical += len(items)
        physical += sum(len(physical_symbols(item)) for item in items)
    return stages


def _explicit_chunks(pattern: HybridPattern, pp_size: int,
                     num_virtual_stages: int | None) -> list[list[Item]]:
    count = len(pattern.segments)
    if count % pp_size:
        raise pattern_error(pattern.text, f"{count} pipeline segments cannot be divided among "
                            f"pp_size={pp_size} ranks; with '|' separators the number of "
                            "segments must be divisible by pp_size")
    implied = count // pp_size
    if num_virtual_stages is not None and num_virtual_stages != implied:
        raise pattern_error(pattern.text, f"num_virtual_stages={num_virtual_stages} does not "
                            f"match the {count} segments / pp_size={pp_size} = {implied} "
                            "virtual stages set by the '|' separators")
    return pattern.segments


def _even_chunks(pattern: HybridPattern, num_stages: int) -> list[list[Item]]:
    total = pattern.num_physical_layers
    if total % num_stages:
        raise pattern_error(pattern.text, f"{total} physical layers cannot be split evenly "
                            f"into {num_stages} pipeline stages; the layer count must be "
                            "divisible by pp_size * num_virtual_stages, or place '|' "
                            "separators to choose the split explicitly")
    per_stage = total // num_stages
    chunks, current, filled = [], [], 0
    for item, pos in zip(pattern.main, _main_item_positions(pattern.text)):
        size = len(physical_symbols(item))
        # Only a group can overshoot, since filled < per_stage here.
        if filled + size > per_stage:
            raise char_error(pattern.text, pos, f"opens a group that an even split into "
                             f"{num_stages} stages of {per_stage} physical layers "
                             "would cut through; place '|' separators explicitly")
        current.append(item)
        filled += size
        if filled == per_stage:
            chunks.append(current)
            current, filled = [], 0
    return chunks


def _main_item_positions(text: str) -> list[int]:
    """Pattern position of each main item (a group counts at its '[', a parallel group at
    its '('); `text` is valid."""
    positions, inside = [], None  # the closing character of the group being read
    for pos, ch in enumerate(text):
        if ch == "/":
            break
        if ch == inside:
            inside = None
        elif ch != "|" and inside is None:
            positions.append(pos)
            inside = {"[": "]", "(": ")"}.get(ch)
    return positions


def stages_per_rank(parallelism: ParallelismSection, model_args: HybridModelArgs) -> int:
    """Virtual stages per rank: set by `|` segments when the pattern has them, else 1 for
    single-stage schedules and 2 (V-shaped schedules: exactly 2) for looped ones, unless
    parallelism.pipeline_parallel_layers_per_stage says otherwise."""
    pp = parallelism.pipeline_parallel_degree
    schedule = get_schedule_class(parallelism.pipeline_parallel_schedule)
    single = issubclass(schedule, PipelineScheduleSingle)
    pattern = model_args.parsed_pattern
    if len(pattern.segments) > 1:
        count = len(pattern.segments) // pp if len(pattern.segments) % pp == 0 else 0
    elif parallelism.pipeline_parallel_layers_per_stage:
        per_stage = parallelism.pipeline_parallel_layers_per_stage
        count = pattern.num_physical_layers // (per_stage * pp)
        if count * per_stage * pp != pattern.num_physical_layers:
            raise ValueError(
                f"parallelism.pipeline_parallel_layers_per_stage={per_stage}: the "
                f"{pattern.num_physical_layers} physical layers of '{model_args.pattern}' are not "
                f"a multiple of layers_per_stage * pipeline_parallel_degree={per_stage * pp}")
    else:
        count = 1 if single else 2
    if single and count != 1:
        raise ValueError(
            f"parallelism.pipeline_parallel_schedule '{parallelism.pipeline_parallel_schedule}' "
            f"runs one stage per rank, but the pattern / layers_per_stage give {count}; use a "
            "looped schedule (e.g. Interleaved1F1B) or fewer '|' segments")
    if schedule in (ScheduleZBVZeroBubble, ScheduleDualPipeV) and count != 2:
        raise ValueError(
            f"parallelism.pipeline_parallel_schedule '{parallelism.pipeline_parallel_schedule}' "
            f"needs exactly 2 stages per rank, the pattern gives {count}")
    if not single and count < 2:
        raise ValueError(
            f"parallelism.pipeline_parallel_schedule '{parallelism.pipeline_parallel_schedule}' "
            f"needs at least 2 stages per rank, the pattern gives {count}")
    return count


def module_names_per_stage(model_args: HybridModelArgs, pp: int,
                           virtual_stages: int) -> list[list[str]]:
    """The model's module names that each pipeline stage keeps, in stage order."""
    pattern = model_args.parsed_pattern
    stages = pipeline_stages(pattern, pp, virtual_stages)
    names = []
    for stage in stages:
        kept = [f"layers.{stage.first_logical_index + offset}" for offset in range(len(stage.items))]
        if stage.index == 0:
            kept.insert(0, "tok_embeddings")
        if stage.index == len(stages) - 1:
            kept += ["hc_head"] if model_args.hc_mult else []
            kept += ["norm", "output"] + [f"mtp.{depth}" for depth in range(pattern.mtp_depths)]
        names.append(kept)
    return names
