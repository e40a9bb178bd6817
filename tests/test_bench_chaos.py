"""``headroom bench chaos`` refusing at once what cannot run (exit 2, one line naming
the fix): ``--hog`` without a CUDA device, ``--token`` or ``--faults-dir`` without the
``--url`` they describe; and a run whose ``--hog`` process died is not a clean run."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from service.bench.chaos import ChaosReport
from service.cli.commands import main


def invoke(args: list[str]):
    return CliRunner().invoke(main, ["bench", "chaos", *args], env={"HEADROOM_CONFIG": os.devnull})


def test_hog_without_a_cuda_device_is_refused_up_front():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: --hog can run")
    for hog in ("1", "1GiB", "2560MiB"):  # a number of GiB or a size, as --device-total takes
        result = invoke(["--hog", hog])
        assert result.exit_code == 2, result.output
        assert result.stderr.strip() == (
            "headroom: error: --hog needs an NVIDIA GPU and torch's CUDA build (torch sees no CUDA "
            "device here); leave --hog out to play a simulated card")
        assert "chaos: waiting" not in result.output
    result = invoke(["--hog", "lots"])
    assert result.exit_code == 2 and "6GiB" in result.output and "GiB, e.g. 2.5" in result.output, result.output


@pytest.mark.parametrize(("args", "flag"), [(["--token", "abc"], "--token"), (["--faults-dir", "x"], "--faults-dir")])
def test_options_of_a_running_service_need_its_url(args, flag):
    result = invoke(args)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (
        f"headroom: error: {flag} goes with --url (the service the run starts keeps its token "
        "and fault folder in --workdir)")


def test_a_url_where_nothing_answers_fails_at_once(tmp_path, monkeypatch):
    """A service the run did not start must answer now: it is not waited for 15 minutes
    as a starting one is; a root that is no service's (404) is named. No folder is left
    behind: before, each such run left an empty headroom-chaos-* folder in the temp
    folder (the started service's workdir, made for a run that starts none)."""
    import socket
    import tempfile

    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    result = invoke(["--url", f"http://127.0.0.1:{port}", "-n", "1", "--kills", "0", "--ooms", "0"])
    assert result.exit_code != 0, result.output
    assert f"cannot reach http://127.0.0.1:{port}" in result.output
    assert "chaos: waiting" not in result.output
    assert list(temp.iterdir()) == []


@pytest.mark.timeout(120)
def test_a_service_that_exits_before_it_is_ready_fails_at_once(tmp_path):
    """Before, a started service that exited at once (a --model that names no model, a
    bad --serve-arg) was waited for as a starting one, 15 minutes, the run printing
    nothing but 'chaos: waiting'. Now the run ends as soon as the service has exited,
    with its exit code and its log's last line."""
    missing = tmp_path / "no-such-model"
    result = invoke(["--model", str(missing), "--device", "cpu", "-n", "1", "--kills", "0", "--ooms", "0",
                     "--workdir", str(tmp_path / "work")])
    assert result.exit_code == 1, result.output
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("headroom: error: chaos run: the started headroom serve exited with code 2 "
                            "before it was ready; its log ends: headroom: error: model not found: "
                            f"{missing}"), error
    assert error.endswith(f"(log: {tmp_path / 'work' / 'serve.log'})"), error



    clean = ChaosReport(pages_leaked=0)
    assert clean.problems() == []
    died = ChaosReport(pages_leaked=0, hog_exit_code=1)
    assert died.problems() == [
        "the memory hog (--hog) died during the run (exit code 1; its error is above): the "
        "desktop's load the run was to play stopped"]
