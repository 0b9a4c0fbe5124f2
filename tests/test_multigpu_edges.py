"""The multigpu variants' output-folder checks, the same as the cores': refused in one line before any model loads."""

import pytest

from conftest import load_script


def test_an_output_dir_that_is_the_initial_model_or_cannot_be_written_is_refused(tmp_path):
    ppo = load_script("multigpu/async_ppo_multigpu.py")
    model = str(tmp_path / "sft")
    with pytest.raises(
        SystemExit,
        match="error: --output-dir is --model-name-or-path: the trained policy would overwrite the initial one",
    ):
        ppo.check_args(ppo.RunArgs(model_name_or_path=model, output_dir=model + "/"))
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit, match=r"error: --output-dir '.*a_file/out' is not a folder this run can write to"):
        ppo.check_args(ppo.RunArgs(model_name_or_path=model, output_dir=str(tmp_path / "a_file" / "out")))
    with pytest.raises(SystemExit, match=r"error: --weights-dir '.*nowhere': no such folder"):
        ppo.check_args(ppo.RunArgs(model_name_or_path=model, weights_dir=str(tmp_path / "nowhere")))
