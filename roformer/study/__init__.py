"""The position-scheme study as a library (`python -m roformer.study` is its command line):
every scheme's seeds x learning rates trained as one vmapped group on device-held data, the
rate chosen on a validation split, the schemes compared on a test split.

One data flow, one module per step, each importing only the ones above it:

    data.py      the corpus split three ways (by document hash), held as arrays on the device;
                 a pack of the splits for a machine without the corpus
    stats.py     bootstrap intervals over seeds x test items, equivalence verdicts, onsets
    plan.py      the plan, built once from the config (each scheme's pretraining config, rates,
                 budgets, windows, a group's members), its validation and the memory check
    groups.py    one scheme's group: its compiled programs and its training (trunk and
                 cooldown branches), evaluation and record
    records.py   the schemes' records on disk, archives of them, staged and split
    figures.py   the report's figures
    end_state.py where the schemes end: the compute multiplier M(T), the flat test on the gap's
                 slope, power and the end-state verdicts (docs/end-state.md)
    preregistration.py
                 the margins, seeds and power target fixed before any number, and the
                 report header that prints them
    end_state_report.py
                 the report's lead: the scored curves, M(T), the flat test and the end-state
                 verdicts, and their lines
    report.py    the report (study.md, study.json) from the records
    kept.py      the chosen-rate scored members a study keeps for the downstream arm, on disk
    session.py   the study: the splits, the loop over the schemes' groups, resume, the report
                 after each group
    downstream_rules.py
                 the downstream arm's pre-registered rules: the `none` control, paired
                 intervals over pretraining seeds, verdicts
    downstream.py
                 the downstream arm: each kept member fine-tuned with roformer.glue per task,
                 resumable, and its report (downstream.md)

What it shares with pretraining lives where pretraining keeps it: the train step and per-row
sums (roformer.train.steps), device-side masking (roformer.data.masking), a scheme's
pretraining and model config (roformer.train.config). It imports nothing of roformer.ablation.
Importing the package imports none of them.
"""
