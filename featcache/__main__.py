"""`python -m featcache`: the command line."""

from featcache.commands.app import main

main()
