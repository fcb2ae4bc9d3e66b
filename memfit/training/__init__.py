"""Training parts: what a recipe's run is made of, each a module named for what it holds: loading a checkpoint
(meta device, memory-mapped, quantized as it loads), precision, the --quantize and --optimizer registries and their
libraries' layers, the strategy (DDP, FSDP2), the loss, the data, checkpoints and the out_dir they live in, signals,
the loop's small parts, the sample, the loggers and the embedded default. Nothing here reads a run's settings
object, measures memory or predicts it: the wings above do (memfit.observatory, memfit.settings, memfit.prediction).
"""
