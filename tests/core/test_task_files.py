"""A recipe's task file (``task.name: ./file.py:Name``) that cannot be a task stops the CLI
at load (exit 2) with one message naming the file, the line and the error."""

from __future__ import annotations

import pytest
import yaml

from polyrl.core.runner.cli import main

GOOD = """\
def write_dataset(out_dir, seed=0, *, rows: int = 4):
    return out_dir, out_dir
"""


def _run(tmp_path, capsys, source: str, name: str) -> tuple[int, str, str]:
    """Write ``source`` as my_task.py beside a recipe naming ``./my_task.py:<name>``, run
    ``polyrl train`` and return (status, stderr, the file's absolute path)."""
    (tmp_path / "my_task.py").write_text(source)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "task": {"name": f"./my_task.py:{name}", "args": {"rows": 3}},
                "policies": {"main": {"model": str(tmp_path / "no-model")}},
                "run": {"dir": str(tmp_path / "run")},
            }
        )
    )
    code = main(["train", str(recipe)])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, err, str((tmp_path / "my_task.py").resolve())


@pytest.mark.parametrize(
    "source, line, error",
    [
        (GOOD.replace("out_dir, out_dir", "(out_dir, out_dir"), 2, "SyntaxError: '(' was never"),
        ("import polyrl_no_such_module_zz\n" + GOOD, 1, "No module named 'polyrl_no_such_mo"),
        (GOOD + "\nLIMIT = 10 // 0\n", 4, "ZeroDivisionError"),
    ],
    ids=["syntax-error", "missing-import", "error-while-importing"],
)
def test_a_task_file_that_cannot_import_names_file_and_line(tmp_path, capsys, source, line, error):
    code, err, file = _run(tmp_path, capsys, source, "task")
    assert code == 2
    assert f"{file}, line {line}: " in err and error in err


def test_a_name_that_is_not_a_task_says_what_it_is_and_where(tmp_path, capsys):
    source = GOOD.replace("write_dataset", "make_rows") + "\nLIMIT = 3\n"
    code, err, file = _run(tmp_path, capsys, source, "make_rows")
    assert code == 2
    assert f"{file}:make_rows' is not a task" in err
    assert f"function make_rows ({file}, line 1) has no write_dataset()" in err
    code, err, file = _run(tmp_path, capsys, source, "LIMIT")
    assert code == 2 and f"{file}:LIMIT' is not a task" in err and "int 3" in err


def test_a_good_task_file_binds_its_options(tmp_path):
    """A class with write_dataset in such a file is a task: its keyword is its option."""
    import polyrl.core  # noqa: F401
    from polyrl.core.config import load
    from polyrl.core.recipe import Config

    (tmp_path / "my_task.py").write_text(
        "class Counting:\n"
        "    @staticmethod\n"
        "    def write_dataset(out_dir, seed=0, *, rows: int = 4):\n"
        "        return out_dir, out_dir\n"
    )
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "task": {"name": "./my_task.py:Counting", "args": {"rows": 3}},
                "policies": {"main": {"model": "some/model"}},
            }
        )
    )
    assert load(Config, recipe).task.args.rows == 3
