"""A recipe's settings: the command line (one line per mistake), what each flag becomes (resolve), whether it is
allowed (checks), the card budgets, the one frozen run value, a recipe's whole resolution (recipe), and the
instruments a run is measured with. Above the training parts and the observatory, which it puts together; below the
estimator, which reads a run's settings.
"""
