"""Parallel state travels in the ParallelPlan, never as attributes on modules or parameters.

An AST walk of the package finds every write of an attribute on an object other than the
writer's own (`self.x = ...`, `self.a.b = ...`), every setattr / delattr and every `__dict__`
access. Each must be one of the kinds below that carry no parallel state; a new one fails here,
with the advice to put parallel state in titan_hybrid.parallel.plan.ParallelPlan instead.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "titan_hybrid"

# Writers whose objects are their own: the object itself (self / cls), autograd contexts, and
# the plan builder's record.
OWN_BASES = {"self", "cls", "ctx", "plan"}
# The fence: patches of torch / torchtitan live behind compat/ and the CPU runtime.
FENCED = ("compat/", "runtime/")
# (file, written target): why it is not parallel state.
ALLOWED = {
    ("checkpoint/manager.py", "trainer.step"): "the train state a checkpoint restores",
    ("checkpoint/manager.py", "trainer.ntokens_seen"): "the train state a checkpoint restores",
    ("checkpoint/split.py", "wrapper.chunks"): "a tensor subclass filled in by its __new__",
    ("checkpoint/split.py", "wrapper.source"): "a tensor subclass filled in by its __new__",
    ("checkpoint/split.py", "wrapper.fused_key"): "a tensor subclass filled in by its __new__",
    ("checkpoint/split.py", "wrapper.tp_layout"): "a tensor subclass filled in by its __new__",
    ("checkpoint/split.py", "chunks.fused_key"): "the state-dict key of a chunked value",
    ("data/build_tokenizer.py", "tokenizer.pre_tokenizer"): "building a tokenizer",
    ("data/build_tokenizer.py", "tokenizer.decoder"): "building a tokenizer",
    ("data/build_tokenizer.py", "tokenizer.post_processor"): "building a tokenizer",
    ("checkpoint/manager.py", "checkpoint_config.async_mode"):
        "torchtitan's manager, replaced at once, built synchronous (no gloo group), then restored",
    ("model/module_classes.py", "module.__class__"):
        "behaviour added by extending the module's class, as FSDP2's fully_shard does",
    ("parallel/compile.py", "module.__dict__"):
        "the compiled forward that the extended class's forward runs",
    ("parallel/tensor_parallel.py", "module.__dict__"):
        "what the extended class reads parameters by: the region depth, the Partial names",
    ("parallel/tensor_parallel.py", "owner.__dict__"):
        "the region depth of each owner, counted by the region's hooks",
    ("parallel/context_parallel.py", "setattr(mixer, rule.core, wrapped)"):
        "a submodule replaced by its CP wrapper, as torch's parallelize_module does",
    ("parallel/context_parallel_compressed.py", "compressor.context_parallel_group"):
        "the group the extended compressor class exchanges pieces over",
    ("parallel/ep_overlap.py", "dispatcher.overlap"):
        "the plan's dispatcher (a plain object, not a module) learns its coordinator",
    ("parallel/zero1.py", "param.grad"): "torch's own gradient slot",
    ("adapters/torchtitan_0_3/toml_job.py", "setattr(target, path[-1], value)"):
        "a TOML job's values onto the torchtitan 0.3 config it becomes",
    ("adapters/torchtitan_0_3/trainer.py", "config.model_spec"):
        "torchtitan 0.3's contract: the trainer's config carries the ModelSpec",
    ("adapters/torchtitan_0_3/model_spec.py", "loss_config.mtp_loss_coeff"):
        "a user's job's HybridLoss takes the model's MTP weight unless the job set one",
    ("adapters/torchtitan_0_3/trainer.py", "config.loss.mtp_loss_coeff"):
        "the run's MTP coefficient on the loss config torchtitan builds the loss from",
    ("adapters/torchtitan_0_3/trainer.py", "config.hf_assets_path"):
        "the tokenizer folder, resolved, where torchtitan 0.3 reads it",
    ("config_registry.py", "config.__name__"): "a config function named after its TOML job",
    ("config_registry.py", "config.__qualname__"): "a config function named after its TOML job",
    ("config_registry.py", "config.__doc__"): "a config function named after its TOML job",
    ("adapters/torchtitan_0_2/trainer.py", "scaled_loss_of(self.pp_schedule).global_valid_tokens"):
        "the step's token count on the schedule's loss function",
    ("adapters/torchtitan_0_3/trainer.py", "scaled_loss_of(self.pp_schedule).global_valid_tokens"):
        "the step's token count on the schedule's loss function",
    ("training/validation.py", "stage.get_local_bwd_output"): "forward-only validation of a stage",
    ("training/validation.py", "stage.set_local_bwd_input"): "forward-only validation of a stage",
    ("training/validation.py", "scaled.loss_fn"):
        "the validation loss on the schedule's loss function",
    ("training/validation.py", "scaled.global_valid_tokens"): "the validation token count",
}
# Attribute names parallel code once hung on modules and parameters (the others, zero1_mesh,
# partition_sizes, ..., are now ParallelPlan / TPLayout fields).
FORMER_ATTRIBUTES = {"param_layouts", "tp_partial_grad", "ep_dispatcher",
                     "tensor_model_parallel", "partition_dim", "tensor_parallel_partial_grad",
                     "tp_saved_params"}


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node


def foreign_writes(source: str) -> list[tuple[int, str]]:
    """(line, target) of every write into another object's attributes in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
                    root = _root(sub)
                    if not (isinstance(root, ast.Name) and root.id in OWN_BASES):
                        found.append((node.lineno, ast.unparse(sub)))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("setattr", "delattr")):
            found.append((node.lineno, ast.unparse(node)))
        if isinstance(node, ast.Attribute) and node.attr == "__dict__":
            root = _root(node)
            if not (isinstance(root, ast.Name) and root.id in OWN_BASES):
                found.append((node.lineno, ast.unparse(node)))
    return found


def former_attribute_uses(source: str) -> list[tuple[int, str]]:
    """(line, name) of every use of a former parallel-state attribute: `x.name`, or the name
    as a string constant (getattr / hasattr / __dict__ keys)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in FORMER_ATTRIBUTES:
            found.append((node.lineno, node.attr))
        if isinstance(node, ast.Constant) and node.value in FORMER_ATTRIBUTES:
            found.append((node.lineno, node.value))
    return found


def package_files():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), path.read_text()


def test_no_parallel_state_is_written_onto_modules_or_parameters():
    unexplained = []
    for name, source in package_files():
        if name.startswith(FENCED):
            continue
        unexplained += [f"{name}:{line}: {target}" for line, target in foreign_writes(source)
                        if (name, target) not in ALLOWED]
    assert not unexplained, (
        "writes into other objects' attributes (parallel state belongs in ParallelPlan; "
        "anything else: add it to ALLOWED with the reason):\n" + "\n".join(unexplained))


def test_allowed_writes_still_exist():
    """A stale entry would let a new write of the same text through unnoticed."""
    present = {(name, target) for name, source in package_files()
               for _, target in foreign_writes(source)}
    assert not set(ALLOWED) - present, sorted(set(ALLOWED) - present)


def test_former_parallel_attributes_are_gone():
    uses = [f"{name}:{line}: {attr}" for name, source in package_files()
            for line, attr in former_attribute_uses(source)]
    assert not uses, uses


def test_the_rules_catch_what_they_are_for():
    """The walk sees the patterns the plan replaced (checked on sources written like the old
    code), and leaves an object's own state alone."""
    old = ("def f(model, param, module, dp_mesh, layouts, experts, d):\n"
           "    model.zero1_mesh = dp_mesh\n"
           "    param.tensor_model_parallel = True\n"
           "    module.__dict__['param_layouts'] = layouts\n"
           "    setattr(experts, 'ep_dispatcher', d)\n")
    assert {target for _, target in foreign_writes(old)} == {
        "model.zero1_mesh", "param.tensor_model_parallel", "module.__dict__",
        "setattr(experts, 'ep_dispatcher', d)"}
    assert {attr for _, attr in former_attribute_uses(old)} == {
        "tensor_model_parallel", "param_layouts", "ep_dispatcher"}
    own = ("class A:\n"
           "    def __init__(self, plan, m):\n"
           "        self.x = 1\n"
           "        self.inner.y = 2\n"
           "        plan.zero1_mesh_of_plan = m\n")
    assert foreign_writes(own) == []
