"""``python -m loadtests.bench``: the stack against direct vLLM (see ``loadtests.bench.run``)."""

from __future__ import annotations

import sys

from loadtests.bench.run import main

sys.exit(main())
