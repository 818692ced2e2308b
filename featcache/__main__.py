from featcache.cli import main

main()
