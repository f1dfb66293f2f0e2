from token_proxy.cli import main

main()
