import sys

from .main import console

sys.exit(console())
