"""Prediction: a script's own train_step on fake tensors (fake_step), the estimate of its peak by role and phase,
what --estimate prints and draws, the planner's settings that fit a budget, and the most that fits (the longest
sequence, largest micro-batch, fewest devices and checkpointed blocks).
"""
