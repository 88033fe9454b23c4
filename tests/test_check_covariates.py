"""`python -m features.check` with known, static and categorical user features: roles, kinds, labels, problems."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.artifacts import run_main
from tests.test_score_covariates import covariate_bars

ROLE_FLAGS = ("--features", "regime", "--known-features", "event,session", "--static-features", "vol_scale,exchange",
              "--categorical-features", "regime,session,exchange")


def run_check(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return run_main(["-m", "features.check", *map(str, args)])


@pytest.fixture(scope="module")
def bars(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return covariate_bars(tmp_path_factory.mktemp("check") / "bars.parquet")


def with_column(src: Path, out: Path, name: str, values: pa.Array) -> Path:
    table = pq.read_table(src)
    pq.write_table(table.set_column(table.schema.get_field_index(name), name, values), out)
    return out


def test_check_reports_each_user_features_role_kind_and_labels(bars: Path) -> None:
    done = run_check(bars, *ROLE_FLAGS)
    assert done.returncode == 0, done.stderr
    assert ("user features:\n"
            "  regime: observed categorical, 3 distinct label(s): calm, panic, storm\n"
            "  event: known real\n"
            "  session: known categorical, 2 distinct label(s): am, pm\n"
            "  vol_scale: static real\n"
            "  exchange: static categorical, 2 distinct label(s): CME, ICE\n") in done.stdout
    assert done.stdout.endswith("no problems found\n")


def test_check_names_a_static_feature_that_varies_and_a_float_categorical(bars: Path, tmp_path: Path) -> None:
    table = pq.read_table(bars)
    exchange = table["exchange"].to_pylist()
    exchange[70] = "EUREX"  # an ES bar
    varies = with_column(bars, tmp_path / "varies.parquet", "exchange", pa.array(exchange))
    done = run_check(varies, *ROLE_FLAGS)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(f"{varies}: 1 problem(s) found\n  {varies}: static feature 'exchange' varies within "
                                  "series ES ("), done.stderr
    assert "'EUREX'" in done.stderr and "give a changing column with --known-features or --features" in done.stderr

    floats = with_column(bars, tmp_path / "floats.parquet", "session", pa.array([0.5] * table.num_rows))
    done = run_check(floats, *ROLE_FLAGS)
    assert done.returncode == 2
    assert ("categorical feature column 'session' has type double. Fix: cast it to integers or text if its values "
            "are categories, or leave it out of --categorical-features") in done.stderr

    nulls = with_column(bars, tmp_path / "nulls.parquet", "regime", pa.array([None, *table["regime"].to_pylist()[1:]]))
    done = run_check(nulls, *ROLE_FLAGS)
    assert done.returncode == 2 and "categorical feature 'regime' is null" in done.stderr


def test_check_refuses_a_column_in_two_roles_and_a_categorical_in_none(bars: Path) -> None:
    done = run_check(bars, "--features", "event", "--known-features", "event")
    assert done.returncode == 2
    assert done.stderr == ("error: user feature 'event' is given to --features and --known-features: a column has one "
                           "role; keep it in one of them\n")
    done = run_check(bars, "--categorical-features", "regime")
    assert done.returncode == 2 and "--categorical-features regime: not given a role" in done.stderr
