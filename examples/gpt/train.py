"""Main job: GPT through dsx.initialize (see dsx/examples/gpt.py and docs/gpt.md)."""

from dsx.examples.gpt import main
from dsx.runtime.process import exit_distributed

if __name__ == "__main__":
    main()
    exit_distributed()
