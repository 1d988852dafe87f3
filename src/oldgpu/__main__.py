import sys

from oldgpu.cli import main

sys.exit(main())
