"""The input benchmark runs end to end on a small slice of the shared data."""
from roformer import cli
from roformer.bench import input as input_bench


def test_input_benchmark_reports_every_stage(shared_data):
    command = cli.CommandFlags("input")
    input_bench.define_flags(command)
    args, _ = command.parse(["--files", str(shared_data / "wikipedia_en" / "wiki_0[78]"), "--seq-len=32,64",
                             "--batch-size", "4", "--batches", "3", "--rounds", "1", "--processes=1,2",
                             "--streams", "2", "--stream-workers", "1", "--stream-pause", "0.01"])
    result = input_bench.run(args)
    stages = [row["stage"] for row in result["rows"]]
    assert stages[0].startswith("raw encode") and stages[1].startswith("shards build")
    assert [row["setting"] for row in result["rows"][2:4]] == ["L=32 B=4 packed", "L=64 B=4 packed"]
    assert stages[4:7] == ["stream batches, caller's time"] * 3
    assert [row["setting"] for row in result["rows"][4:7]] == [
        "2 streams L=32 B=4, in process", "2 streams L=32 B=4, 1 workers back to back",
        "2 streams L=32 B=4, 1 workers, made ahead (0.01 s pause)"]
    assert stages[7:] == ["prepare (spawned processes)"] * 2
    assert [row["setting"].split(" x ")[0] for row in result["rows"][7:]] == ["1", "2"]
    assert all(row["M_tokens_per_s"] > 0 for row in result["rows"])
    assert result["rows"][0]["tokens"] == result["rows"][1]["tokens"] == result["corpus"]["tokens"]
    assert result["rows"][7]["tokens"] == result["rows"][8]["tokens"] == result["corpus"]["tokens"]
