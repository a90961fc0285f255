"""The study's figures (roformer/study/figures.py)."""


def test_the_report_names_the_figures_it_wrote(tmp_path):
    """A call that finished only schemes with nothing to follow (rope, first by its time limit)
    writes no signal figure, and its study.md does not name one."""
    from roformer.study import figures as study_figures

    band = {"median": [1.0, 0.5], "lo": [0.9, 0.4], "hi": [1.1, 0.6]}

    def info(signal):
        return {"tokens": [0, 100], "validation": band, "rate": 1e-3, "onsets": [{"left_censored": False}],
                "onset_curve": {"grid": [0, 100], "fraction": [0.0, 0.5], "lo": [0.0, 0.2], "hi": [0.0, 0.8]},
                "spectrum": {"shuffle2": band, "reverse": band}, "signal": signal}

    for schemes in ({"rope": info({})}, {"rope": info({}), "alibi": info({"slope_max": band})}):
        workdir = tmp_path / "-".join(schemes)
        workdir.mkdir()
        study_figures.figures({"schemes_info": schemes}, workdir)
        assert sorted(p.name for p in workdir.iterdir()) == sorted(study_figures.figure_names(schemes))
        assert ("study_signal.png" in study_figures.figure_names(schemes)) == ("alibi" in schemes)
