"""Memfit's library: the machinery the recipe scripts share (flags resolved, the model loaded and sharded, memory
measured, estimated, explained and drawn). Each module holds what its name says (docs/design.md's layout lists them)
and never calls back into a script. A regular package, so that only this checkout's modules are ever imported."""
