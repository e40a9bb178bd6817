"""llama.cpp's own benchmarks on the same GGUF file, threads and cores: the comparison
side of ``headroom bench engine --against-llama-cpp PATH``.

``llama-bench`` measures prefill of one prompt (``-p P -n 0``, tokens/s) and decode of
one sequence after a prompt of the same length (``-p 0 -n N -d P``: ``N`` tokens at a
context that starts ``P`` deep); ``llama-batched-bench`` measures decode of ``B``
sequences at once (``-npl B``; its ``speed_tg`` is every sequence's generated tokens
over the decode time, as :class:`engine.bench.speed.Speed` counts them). Both run as
children of this process, so they inherit its CPU affinity (``taskset -c ...`` on the
outer command pins both sides to the same cores), with ``-t`` the number of those cores.

Neither tool ships with headroom; build them from llama.cpp's source (docs/benchmarks.md
gives the recipe). ``PATH`` is the folder that holds them (or its ``build/bin``), or the
``llama-bench`` file itself.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

BENCH = "llama-bench"
BATCHED = "llama-batched-bench"
REPETITIONS = 3  # llama-bench's -r: its figure is the mean of these
ALL_LAYERS = 999  # -ngl for every layer of any model
MAX_SEQUENCES = 256  # llama-batched-bench's -npl limit (llama.cpp's n_seq_max, LLAMA_MAX_SEQ)


def gpu_layers_for_split(num_layers: int, cpu_layers: int) -> int:
    """``-ngl`` that places llama.cpp's layers as an engine running the last ``cpu_layers``
    of its ``num_layers`` decoder layers on the CPU places its own: as many decoder layers
    on the GPU, and the output layer (the LM head) there too. llama.cpp counts the output
    layer as one of ``num_layers + 1`` and offloads the last ``-ngl`` of them
    (``i_gpu_start`` in ``llama_model::load_tensors``), so it keeps its first layers on the
    CPU where the engine keeps its last ones: the same count of layers and bytes.
    :data:`ALL_LAYERS` when nothing runs on the CPU."""
    return ALL_LAYERS if cpu_layers == 0 else num_layers - cpu_layers + 1


BUILD_THEM = (f"build it with `cmake -B build -DGGML_NATIVE=ON && cmake --build build --target {BENCH} {BATCHED}` "
              "in llama.cpp's source (docs/benchmarks.md) and give that folder")


class LlamaCppFailed(RuntimeError):
    """A llama.cpp tool exited with an error or printed no result."""


@dataclass(frozen=True)
class LlamaCppTools:
    """The two llama.cpp programs, the threads they run with (the cores this process
    may use) and the layers they offload to the GPU (``-ngl``; 0 on the CPU, all of them
    when the engine side runs on CUDA)."""

    bench: Path
    batched: Path | None
    threads: int
    gpu_layers: int = 0

    @classmethod
    def find(cls, path: str | os.PathLike) -> LlamaCppTools:
        """The tools at ``path``: a folder holding ``llama-bench`` (directly, in ``bin/``
        or in ``build/bin/``), or the ``llama-bench`` file.

        Raises:
            ValueError: no executable ``llama-bench`` there; the message names the places
                looked at and how to build it.
        """
        if not str(path).strip():
            raise ValueError(f"--against-llama-cpp: an empty path; give llama.cpp's build folder or its {BENCH}")
        given = Path(path).expanduser()
        if given.is_file() and given.name != BENCH:
            raise ValueError(f"--against-llama-cpp {path}: a file that is not {BENCH}; give llama.cpp's build folder "
                             f"or its {BENCH}")
        folders = [given.parent] if given.is_file() else [given, given / "bin", given / "build" / "bin"]
        for folder in folders:
            bench = folder / BENCH
            if bench.is_file() and os.access(bench, os.X_OK):
                batched = folder / BATCHED
                found = batched.is_file() and os.access(batched, os.X_OK)
                return cls(bench, batched if found else None, len(os.sched_getaffinity(0)))
        unrunnable = [str(folder / BENCH) for folder in folders if (folder / BENCH).is_file()]
        if unrunnable:
            raise ValueError(f"--against-llama-cpp {path}: {unrunnable[0]} is not executable; `chmod +x` it, or "
                             f"{BUILD_THEM}")
        raise ValueError(f"--against-llama-cpp {path}: no executable {BENCH} in {', '.join(map(str, folders))}; "
                         f"{BUILD_THEM}")

    def offloading(self, num_layers: int, cpu_layers: int) -> LlamaCppTools:
        """These tools with the ``-ngl`` of :func:`gpu_layers_for_split`: llama.cpp's layers
        placed as an engine of ``num_layers`` decoder layers, its last ``cpu_layers`` on the
        CPU, places its own."""
        return dataclasses.replace(self, gpu_layers=gpu_layers_for_split(num_layers, cpu_layers))

    def check_batches(self, batches: tuple[int, ...]) -> None:
        """Refuse batch sizes these tools cannot measure, before anything runs.

        Raises:
            ValueError: a size above :data:`MAX_SEQUENCES` (``llama-batched-bench``'s
                limit), or a size above 1 without ``llama-batched-bench`` beside
                ``llama-bench``; the message names the fix.
        """
        over = [b for b in batches if b > MAX_SEQUENCES]
        if over:
            raise ValueError(f"--batches {','.join(map(str, over))}: {BATCHED} runs at most {MAX_SEQUENCES} sequences "
                             f"at once (llama.cpp's n_seq_max): give --batches sizes up to {MAX_SEQUENCES} with "
                             "--against-llama-cpp")
        several = [b for b in batches if b > 1]
        if several and self.batched is None:
            raise ValueError(f"--batches {','.join(map(str, several))} needs {BATCHED}, and there is no executable "
                             f"{BATCHED} beside {self.bench}; build it with `cmake --build build --target {BATCHED}` "
                             "in llama.cpp's source (docs/benchmarks.md), or give --batches 1")

    def _run(self, argv: list[str]) -> str:
        """Run one tool; its stdout. Raises LlamaCppFailed with its stderr's tail when it fails."""
        try:
            done = subprocess.run(argv, capture_output=True, text=True, check=False)
        except OSError as exc:  # not a program this machine runs (another platform's, a text file)
            raise LlamaCppFailed(f"cannot run {argv[0]}: {exc.strerror}; is it llama.cpp's "
                                 f"{Path(argv[0]).name}? {BUILD_THEM}") from None
        if done.returncode != 0:
            raise LlamaCppFailed(f"{' '.join(argv)} exited {done.returncode}: {done.stderr[-2000:]}")
        return done.stdout

    def _bench(self, model: Path, *args: str) -> float:
        """``llama-bench``'s mean tokens/s (``avg_ts``) of one test."""
        out = self._run([str(self.bench), "-m", str(model), "-t", str(self.threads), "-ngl", str(self.gpu_layers),
                         "-r", str(REPETITIONS), "-o", "json", *args])
        try:
            tests = json.loads(out)
            if len(tests) != 1:
                raise LlamaCppFailed(f"{BENCH} {' '.join(args)}: expected one test, got {len(tests)}")
            return float(tests[0]["avg_ts"])
        except (ValueError, TypeError, KeyError, IndexError):
            raise LlamaCppFailed(self._not_a_result(self.bench, out)) from None

    @staticmethod
    def _not_a_result(tool: Path, out: str) -> str:
        """The error for a tool whose output holds no result of llama.cpp's: likely some
        other program under its name."""
        head = out.strip().splitlines()[0][:80] if out.strip() else ""
        return (f"{tool} printed no {tool.name} result ({f'its output starts {head!r}' if head else 'no output'}): "
                f"is it llama.cpp's {tool.name}? {BUILD_THEM}")

    def speed(self, model: Path, batch: int, prompt_tokens: int, new_tokens: int) -> tuple[float, float | None]:
        """(prefill, decode) tokens/s of ``batch`` prompts of ``prompt_tokens`` each, then
        ``new_tokens`` each decoded together; decode None for ``batch`` > 1 without
        ``llama-batched-bench``.

        One prompt: ``llama-bench -p P -n 0``, then ``-p 0 -n N -d P`` (decode at a
        context that starts ``P`` deep). More: ``llama-batched-bench -npp P -ntg N -npl B``
        (its ``speed_pp`` and ``speed_tg``).

        Raises:
            LlamaCppFailed: a tool failed (its stderr's tail) or printed no result.
        """
        if batch == 1:
            return (self._bench(model, "-p", str(prompt_tokens), "-n", "0"),
                    self._bench(model, "-p", "0", "-n", str(new_tokens), "-d", str(prompt_tokens)))
        if self.batched is None:
            return float("nan"), None
        ctx = batch * (prompt_tokens + new_tokens) + 16
        out = self._run([str(self.batched), "-m", str(model), "-t", str(self.threads), "-tb", str(self.threads),
                         "-ngl", str(self.gpu_layers), "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(prompt_tokens),
                         "-ntg", str(new_tokens), "-npl", str(batch), "--output-format", "jsonl"])
        try:
            rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            return float(rows[-1]["speed_pp"]), float(rows[-1]["speed_tg"])
        except (ValueError, TypeError, KeyError, IndexError):
            raise LlamaCppFailed(self._not_a_result(self.batched, out)) from None
