"""`python -m symbiont.service ...` runs `symbiont serve-base ...` without the other subcommands."""

import argparse
import logging
import sys

from symbiont.cli import serve_base

parser = argparse.ArgumentParser(prog="python -m symbiont.service")
serve_base.add_arguments(parser)
args = parser.parse_args()
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
sys.exit(serve_base.run(args))
