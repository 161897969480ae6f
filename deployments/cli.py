"""The `specdec` console script: the in-process commands of specdec_core plus serving."""

from __future__ import annotations

from specdec_core.cli import app


def main() -> None:
    app()


if __name__ == "__main__":
    main()
