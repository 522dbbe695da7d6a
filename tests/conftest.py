"""Suite-wide settings. In CI (``CI`` set, as ``.ci/run`` runs) hypothesis draws the same examples on
every run (``derandomize``): a property test then cannot pass on one clean clone and fail on the next
by the luck of its draw; run locally, it keeps exploring new examples."""
import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
