"""Memfit's library: the machinery the recipe scripts share (flags resolved, the model loaded and sharded, memory
measured, estimated, explained and drawn), one concern a module, each a leaf tool that never calls back into a
script. A regular package, so that only this checkout's modules are ever imported."""
