"""`slotmap explore`: a whole run of spec, step by step, as one self-contained HTML page.

    run = seeded_run(seed=0)                 # or worked_example_run(), or shadow_run(config, checker.steps)
    write_page(run, Path("run.html"))       # open it in a browser: no network needed

`record` drives spec's pool through the run and keeps every step's snapshots and `explain`'s rows;
`changes` and `blocks` read what changed and what the KV cache holds from those snapshots; `export`
turns the run into the compact JSON the page embeds; `page` writes the HTML around it. The page's
script only shows and highlights numbers computed here: it implements no part of the mapping.
"""

from slotmap.explore.page import write_page
from slotmap.explore.record import Recorder, Run, StepRecord
from slotmap.explore.sources import seeded_run, shadow_run, worked_example_run

__all__ = ["Recorder", "Run", "StepRecord", "seeded_run", "shadow_run", "worked_example_run", "write_page"]
