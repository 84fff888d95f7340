"""Facts about the CUDA toolkit installed on the host (not the CUDA the driver supports)."""

from __future__ import annotations

import re
from collections.abc import Iterable

from typing_extensions import override

from facts.base import FactBase

# Where NVIDIA's packages and runfile put the toolkit; its bin/ is often not on PATH
# for non-login shells (which is how pyinfra runs commands).
DEFAULT_NVCC = "/usr/local/cuda/bin/nvcc"

_RELEASE_RE = re.compile(r"release (\d+\.\d+)(?:, V(\d+(?:\.\d+)+))?")


def parse_nvcc_version(lines: Iterable[str]) -> dict[str, str | None] | None:
    """``Cuda compilation tools, release 12.1, V12.1.105`` ->
    ``{"release": "12.1", "version": "12.1.105"}``; ``version`` is None when the ``V``
    part is missing. None without a ``release`` line."""
    for line in lines:
        match = _RELEASE_RE.search(line)
        if match is not None:
            return {"release": match.group(1), "version": match.group(2)}
    return None


class CudaToolkit(FactBase[dict[str, str | None] | None]):
    """
    Returns the CUDA toolkit's version from ``nvcc --version`` (nvcc on PATH, else
    ``/usr/local/cuda/bin/nvcc``), or None when there is no nvcc:

    .. code:: python

        {"release": "12.1", "version": "12.1.105"}
    """

    # No requires_command: nvcc is usually off PATH, so the command looks in both
    # places itself and prints nothing when neither has it.
    @override
    def command(self) -> str:
        # The toolkit is optional (vLLM's wheels bring their own CUDA runtime), so a
        # broken nvcc reads as "no toolkit" rather than failing the host.
        return (
            "if command -v nvcc >/dev/null 2>&1; then nvcc --version 2>&1 || :; "
            f"elif test -x {DEFAULT_NVCC}; then {DEFAULT_NVCC} --version 2>&1 || :; fi"
        )

    @override
    def process(self, output: list[str]) -> dict[str, str | None] | None:
        return parse_nvcc_version(output)
