"""The position-scheme ablation as a library (`python -m roformer.ablate` is its command line).

One data flow, one module per step, each importing only the ones above it:

    parallel.py       cores for runs side by side on a CPU host (imports nothing of the ablation's)
    settings.py       the numeric settings' rules
    plan.py           what runs: the plan (each scheme's pretraining config, typed runs with their
                      configs, workdirs and stage fingerprints), computed first and once from the
                      config; the stage registry
    validation.py     the plan checked before anything trains, every problem in one error
    state.py          ablation_state.json (per run and stage) and the one status rule
    stages.py         a planned run's stages (pretrain, extrapolation, glue; extension,
                      extension_eval) by their runners, in order, skipped when done, failures recorded
    extrapolation.py  the extrapolation and extension_eval stages' evaluation
    stats.py          means over seeds, paired differences with 95% t-intervals
    onset.py          when each run starts to use word order; fraction of seeds started over tokens
    formats.py        how the report writes numbers: mean ± std, intervals, token counts, tables
    findings.py       the comparison in sentences
    summary.py        aggregation over seeds, paired differences to the reference, convergence
    figures.py        the report's figures
    report_md.py      the report as markdown
    report.py         the report's files, written and read back (no I/O but its own files)
    collect.py        the runs' records and metrics read back into the report's rows
    runner.py         the session: build the plan, validate it, pin the vocabulary, run its runs in
                      turn or side by side, rewrite the report after each
    job.py            the process one run executes in when runs go side by side

Importing the package imports none of them.
"""
