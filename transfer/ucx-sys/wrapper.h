#include <ucp/api/ucp.h>
/* The socket address types ucp's listener and sockaddr endpoints take. */
#include <netinet/in.h>
#include <sys/socket.h>
