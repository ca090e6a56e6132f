"""`python -m deepspeed_z3ext [--build]`: the environment report (report.py)."""
from deepspeed_z3ext.report import main

raise SystemExit(main())
