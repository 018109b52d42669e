"""The study wing: `largebatch study KIND` runs one study, `largebatch study EXPERIMENT.yaml` an experiment file's
studies in order (`largebatch/commands/experiment.py`). A study is cells of `largebatch train`, each in its own run
directory under OUT/runs, summarised into OUT/study.json, study.md and study.png; tuned on a validation split,
never on the test set (a tuning study, then a final one at the lrs it chose).

One module per job:
  protocol.py   the protocol as data (protocol.yaml, and a study's --protocol): optimizer settings, variants,
                the claims and their rules; the figures a row gives beyond top-1
  kinds.py      the kinds, one table: flags, groups, table shape, claims, how study.md and study.png show them
  plan.py       steps 1-2: groups, lrs, cells, each cell's --set list, the check before anything trains
  tuning.py     --from-tuning: the lrs tuning studies chose
  cells.py      steps 3, 5-6: running a cell, its record, signals, the files a user can damage
  directory.py  step 5: OUT belongs to one study; settings of a resumed study; files written whole
  summary.py    step 4: the one summariser (table, chosen lrs) and the study's files
  verdict.py    the one verdict rule of every claim
  tables.py     study.md's tables and study.png per kind
  runner.py     the one runner: `largebatch study KIND`
"""
from largebatch.commands.study.plan import claim_cells

__all__ = ["claim_cells"]
