"""recipes/benchmark.py's run-to-run comparison of ratio columns."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("benchmark_recipe", Path(__file__).parents[2] / "recipes" / "benchmark.py")
benchmark = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(benchmark)

RUN = """### a table
| dp | engine | median step (ms) | / torch DDP | measured / formula |
|---:|---|---:|---:|---:|
| 2 | zero1 | 10.0 | 1.050 | 1.0001 |
| 2 | zero2 | 12.0 | 1.100 | 1.0001 |

text between tables
| loop | ms | x / y |
|---|---:|---:|
| a | 3 | - |"""


def test_only_ratio_columns_are_read() -> None:
    cells = benchmark._ratio_cells(RUN)
    assert [v for _, v in cells] == [1.05, 1.0001, 1.1, 1.0001]  # not the ms columns, not "-"
    assert cells[0][0] == "2 zero1 | / torch DDP"


def test_compare_runs_reports_the_largest_relative_difference() -> None:
    other = RUN.replace("| 1.100 |", "| 1.000 |").replace("12.0", "99.0")
    line = benchmark.compare_runs(RUN, other)
    assert "9.1%" in line and "2 zero2 | / torch DDP" in line
    assert "0.0%" in benchmark.compare_runs(RUN, RUN)


def test_scaling_rows_fill_their_time_budget_within_bounds() -> None:
    from lightning_par.benchmarks.zero import _FULL, _QUICK, scaling_steps

    setup = dict(scaling_steps=10, scaling_budget_s=3.0, scaling_max_steps=300)
    assert scaling_steps(0.5, setup) == 10  # long rounds: the floor
    assert scaling_steps(0.02, setup) == 150  # short rounds: as many as fill 3 s
    assert scaling_steps(0.001, setup) == 300  # capped
    assert scaling_steps(0.0, setup) == 300
    for mode in (_QUICK, _FULL):
        assert mode["scaling_steps"] <= scaling_steps(0.004, mode) <= mode["scaling_max_steps"]


def test_ddp_phase_table_lists_each_stretch_once_with_medians() -> None:
    from lightning_par.benchmarks.ddp import _phase_table

    steps = [{"start -> a": (0.010, 0.009), "a -> end": (0.002, 0.001)},
             {"start -> a": (0.030, 0.029), "a -> end": (0.004, 0.003)},
             {"start -> a": (0.020, 0.019), "a -> end": (0.003, 0.002)}]
    lines = _phase_table({"raw": [], "ours": steps, "theirs": steps[:1]})
    assert lines[0] == "| stretch (wall / CPU, ms) | ours | theirs |"  # a loop without hooks has no column
    assert lines[2] == "| start -> a | 20.00 / 19.00 | 10.00 / 9.00 |"
    assert lines[3] == "| a -> end | 3.00 / 2.00 | 2.00 / 1.00 |"


def test_ddp_step_timer_splits_a_batch_into_stretches_and_times_the_gap_between_batches(monkeypatch) -> None:
    from lightning_par.benchmarks import ddp

    clock = iter([0.0, 1.0, 1.5, 4.0, 4.5, 6.0, 7.0, 8.0])  # start, 4 hooks, end; next batch starts at 7.0
    monkeypatch.setattr(ddp.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(ddp.time, "thread_time", lambda: 0.0)
    timer = ddp.StepTimer()
    for hook in ("on_train_batch_start", "on_before_zero_grad", "on_before_backward", "on_after_backward",
                 "on_before_optimizer_step", "on_train_batch_end", "on_train_batch_start"):
        getattr(timer, hook)()
    assert timer.times == [6.0]
    assert timer.between == [(1.0, 0.0)]  # from the first batch's end (6.0) to the second's start (7.0)
    assert [wall for wall, _ in timer.phases[0].values()] == [1.0, 0.5, 2.5, 0.5, 1.5]
    assert list(timer.phases[0])[2] == "on_before_backward -> on_after_backward"


def test_ddp_sigterm_broadcast_timer_wraps_lightnings_method_and_leaves_it_alone_where_absent() -> None:
    from types import SimpleNamespace

    from lightning_par.benchmarks.ddp import _time_sigterm_broadcast

    calls: list[int] = []
    loop = SimpleNamespace(_broadcast_sigterm_tensor=lambda: calls.append(1))
    times = _time_sigterm_broadcast(SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=loop)))
    loop._broadcast_sigterm_tensor()
    loop._broadcast_sigterm_tensor()
    assert calls == [1, 1] and len(times) == 2 and all(t >= 0 for t in times)  # the original still runs, timed
    bare = SimpleNamespace()
    assert _time_sigterm_broadcast(SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=bare))) == []
    assert not hasattr(bare, "_broadcast_sigterm_tensor")
