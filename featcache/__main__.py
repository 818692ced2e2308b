"""`python -m featcache`: the command line."""

from featcache.cli import main

main()
