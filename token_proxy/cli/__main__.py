from token_proxy.cli.main import main

main()
