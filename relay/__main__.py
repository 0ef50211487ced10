from relay.ops.cli import main

main()
