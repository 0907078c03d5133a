import sys

from dsx.ops.unified_gather import main

sys.exit(main())
