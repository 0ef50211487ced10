from relay.cli.main import main

main()
