"""The position-scheme ablation as a library (`python -m roformer.ablate` is its command line).

One data flow, one module per step, each importing only the ones above it:

    parallel.py       cores for runs side by side on a CPU host (imports nothing of the ablation's)
    plan.py           what runs: per-run configs, validation, jobs, config fingerprints
    state.py          ablation_state.json (per run and stage) and the one status rule
    stages.py         a run's stages (pretrain, extrapolation, glue; extension, extension_eval),
                      run in order, skipped when done, failures recorded
    extrapolation.py  the extrapolation and extension_eval stages' evaluation
    stats.py          means over seeds, paired differences with 95% t-intervals
    onset.py          when each run starts to use word order; fraction of seeds started over tokens
    report.py         aggregation over seeds, findings, markdown and figures (no I/O but its own files)
    collect.py        the runs' records and metrics read back into the report's rows
    runner.py         the session: validate, pin the vocabulary, run the jobs in turn or side
                      by side, rewrite the report after each
    job.py            the process one run executes in when runs go side by side

Importing the package imports none of them.
"""
