"""How a run ends when it fails: out of memory explained (what was alive, the settings that fit), the failure's
ledger and picture, and every other ending (a preemption, a full disk, divergence) in a few lines.
"""
