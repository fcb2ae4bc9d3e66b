"""The observatory: what a run's memory was. The profiler window, the phases a step is measured in, what each role
holds by address, each block's lifetime, the ledger of each phase's peak, the timeline by role, the pictures and the
page, and the run's report (ledger, picture, summary). It uses the training parts below it; what a run is (its
settings) is above it, in memfit.settings.
"""
