"""Each job's GPU memory over its runs (issue 42): who a job is (jobs.py), the bounded file in
the state dir (store.py), the recorder fed from the books once a second (recorder.py, seen.py),
the recommendation (recommend.py) and its picture (plot.py). docs/RECOMMEND.md says how."""
from .recorder import Recorder  # noqa: E402,F401  (what the enforcer and `convgpu trace` build)
from .seen import from_books, from_snapshot  # noqa: E402,F401
from .store import HistoryFile  # noqa: E402,F401
