import sys

from slurm_ext.cli import main

sys.exit(main())
