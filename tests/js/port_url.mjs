// Requests to a sandbox's port URL through the server's own plain listener, the port URL as Host (no DNS): what
// the JS scenarios use to reach a port whatever the client was told (E2B_SANDBOX_URL or only E2B_DOMAIN).

import http from 'node:http'

export const server = new URL(process.env.KEEPSTATE_TEST_API ?? process.env.E2B_SANDBOX_URL) // plain HTTP, the router's

// GET `path` of the port URL `host`: { status, body }.
export function get(host, path = '/', headers = {}) {
  return new Promise((resolve, reject) => {
    const req = http.get({ host: server.hostname, port: server.port, path, headers: { host, ...headers } }, (res) => {
      let body = ''
      res.on('data', (c) => (body += c))
      res.on('end', () => resolve({ status: res.statusCode, body }))
    })
    req.on('error', reject)
    req.setTimeout(60_000, () => req.destroy(new Error('no answer in 60 s')))
  })
}
