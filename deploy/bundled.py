"""Where the bundled demo model lives, and the defaults that point at it."""

from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent / "demo"
BUNDLED_MODEL = DEMO_DIR / "target"      # Qwen3.5 architecture with its MTP layer (mtp.*)
BUNDLED_DFLASH = DEMO_DIR / "dflash"     # a DFlash drafter for it


def bundled_paths(model: str | None, drafter: str | None, method: str) -> tuple[str, str | None]:
    """The model and drafter to use: the given ones, else the bundled ones. The bundled DFlash
    drafter is only a default for the bundled model and the 'dflash' method."""
    if model is None:
        if not (BUNDLED_MODEL / "config.json").is_file():
            raise FileNotFoundError(f"the bundled model is missing at {BUNDLED_MODEL}; "
                                    "pass --model DIR (or train it: metrale train --out DIR)")
        model = str(BUNDLED_MODEL)
    if drafter is None and method == "dflash" and Path(model).resolve() == BUNDLED_MODEL:
        drafter = str(BUNDLED_DFLASH)
    return model, drafter
