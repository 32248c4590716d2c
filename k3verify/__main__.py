"""`python -m k3verify` == the `k3verify` console script."""
from k3verify.cli import main

raise SystemExit(main())
