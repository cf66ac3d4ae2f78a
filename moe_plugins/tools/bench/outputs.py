"""What every bench script does at both ends: a rank runs its JSON config (:func:`run_rank_config`), and the
parent writes its report as STEM.json, STEM.md and STEM.png after checking it (:func:`write_report`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, List, Union

Report = Dict[str, Any]


def write_report(report: Report, out: Path, stem: str, *, problems: Callable[[Report], List[str]],
                 markdown: Callable[[Report], str], plot: Callable[[Report, Path], Any]) -> Report:
    """``out/stem.json``, ``.md`` and ``.png`` of ``report``; a RuntimeError listing ``problems(report)`` first,
    if any, and nothing written."""
    found = problems(report)
    if found:
        raise RuntimeError("the report is malformed: " + "; ".join(found))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown(report))
    plot(report, out / f"{stem}.png")
    print(f"wrote {out}/{stem}.json, .md, .png")
    return report


def run_rank_config(path: Union[str, Path], rank_main: Callable[[Dict[str, Any]], Any]) -> int:
    """One rank of a bench the parent launched: ``rank_main`` on the JSON config at ``path``, then the default
    process group destroyed if the rank made one. 0 (an error propagates: the parent reports the rank's log)."""
    import torch.distributed as dist

    rank_main(json.loads(Path(path).read_text()))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0
