"""The names of the phases Memfit measures, predicts and draws, in order. Apart from ``memfit.observatory.ledger``
(which imports torch and Lightning) so that a tool that only reads a run's files (``python -m memfit.compare``)
starts without them."""

LEDGER_PHASES = ("forward", "backward", "optimizer_step", "zero_grad")
"""The phases of one optimizer step, in order: what a script's train_step measures and the ledger explains. The lists
below derive from it, so a new phase is its name here, its colour in the pictures and its ``with phases(NAME)`` in each
script's train_step."""
TABLE_PHASES = tuple(phase for phase in LEDGER_PHASES if phase != "zero_grad")
"""The phases a table of peaks shows: zero_grad only frees what the optimizer step left, so its peak is never the step's"""
FIRST_OPTIMIZER_STEP = "first_optimizer_step"
"""The first step's optimizer step where it creates the optimizer's state (not a resumed run's, whose state is
loaded; not ``--optimizer_in_backward``'s, whose state is made in backward): ``memfit.observatory.phases.PhaseMemory``
records it under this name as well as ``optimizer_step``, so the step that makes the state shows apart"""
RUN_PHASES = ("resume", FIRST_OPTIMIZER_STEP, "validation", "generation", "save")
"""The run's phases beside its steps, each with memory of its own: a resume's loaded checkpoint beside the model, the
first optimizer step making the optimizer's state, a validation's batches (its own length, no graph), the sample's KV
cache, a checkpoint's state dict. Each script wraps them as it wraps the step's (the first optimizer step is its
step's ``optimizer_step``); ``memfit.observatory.run_phases`` measures their tensor memory where the probe cannot"""
AFTER_BACKWARD = LEDGER_PHASES[LEDGER_PHASES.index("backward") + 1 :]
"""The phases once the step's gradients are complete: FSDP's unsharded accumulation has reduce-scattered them, and each
rank steps its own shard"""
