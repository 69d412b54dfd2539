"""The Lua scripts the Redis backend runs on the store, each on one slot:
the manifest's compare-and-set (CAS), the drop that leaves a tombstone
(DROP), the bounded read of a manifest (READ), the look at what is left of
a version (LOOK), and a tenant's bookkeeping (LIST). Plain text, loaded by the parts that run them.
"""

from tierd.remote.manifest import HEAD_BYTES

_VERSION = f"local HEAD = {HEAD_BYTES}\n" + """
local function head(key)  -- the first HEAD bytes at key; '' for none, or a key of another type: replaced as none
  if redis.call('TYPE', key)['ok'] ~= 'string' then return '' end
  return redis.call('GETRANGE', key, 0, HEAD - 1)
end
local function version(cur)  -- a manifest's or tombstone's number; 0 for one that does not parse: replaced as none
  local v = tonumber(string.match(cur, '^(%d+) ')) or 0
  if v > 99999999999999 then return 0 end
  return v
end
"""

# A change notice (notices.py) on channel `channel`: "KEY VERSION WRITE". Sent before the write it tells of
# (a script runs whole: no one reads the key in between), and by pcall: a store whose ACL gives the user no
# channel refuses the notice, never the write. Returns 1 if it was sent, 0 if refused.
_NOTICE = """
local function notice(channel, text)
  if channel == '' then return 1 end
  local r = redis.pcall('PUBLISH', channel, text)
  if type(r) == 'table' and r.err then return 0 end
  return 1
end
"""

# KEYS[1]: the manifest, KEYS[2..]: the new version's chunks. ARGV: the version expected (0: none), the new
# manifest, its TTL in ms (0: none), the channel of change notices ('': none) and the notice's "VERSION WRITE".
# Returns {1, old manifest's head, notice sent} if switched, {0, current version} if another writer got there
# first, {2, chunks there} if some chunk is not (lost in a fail-over, or evicted already).
CAS = _VERSION + _NOTICE + """
local cur = head(KEYS[1])
local have = version(cur)
if have ~= tonumber(ARGV[1]) then return {0, have} end
local there = 0
for i = 2, #KEYS, 1000 do there = there + redis.call('EXISTS', unpack(KEYS, i, math.min(i + 999, #KEYS))) end
if there ~= #KEYS - 1 then return {2, there} end
local sent = notice(ARGV[4], KEYS[1] .. ' ' .. ARGV[5])
if tonumber(ARGV[3]) > 0 then redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
else redis.call('SET', KEYS[1], ARGV[2]) end
return {1, cur, sent}
"""

# KEYS[1]: the manifest. ARGV: a TTL in ms (0: none), the channel of change notices ('': none). A session
# dropped leaves a tombstone, "N dropped", one version past the one it ends: a node holding a copy of a version
# before it learns the session is gone, and the next history goes on numbering from it. Returns the head of the
# manifest replaced ('': none), and whether a change notice was sent (1; 0: refused).
DROP = _VERSION + _NOTICE + """
local cur = head(KEYS[1])
if redis.call('EXISTS', KEYS[1]) == 0 or (string.match(cur, '^%d+ dropped$') and version(cur) > 0) then
  return {cur, 1}  -- none, or dropped
end
local n = version(cur) + 1
if n > 99999999999999 then n = 1 end  -- past what a Lua number holds exactly
local sent = notice(ARGV[2], KEYS[1] .. ' ' .. n .. ' -')
local tomb = n .. ' dropped'
if tonumber(ARGV[1]) > 0 then redis.call('SET', KEYS[1], tomb, 'PX', ARGV[1]) else redis.call('SET', KEYS[1], tomb) end
return {cur, sent}
"""


# KEYS[1]: a manifest. ARGV[1]: a length (0: none). Returns its length and the whole of it where that is HEAD
# bytes at most or ARGV[1] exactly, else its first HEAD bytes; {0, nil} for none (another type: WRONGTYPE).
READ = f"local HEAD = {HEAD_BYTES}\n" + """
local n = redis.call('STRLEN', KEYS[1])
if n <= HEAD or n == tonumber(ARGV[1]) then return {n, redis.call('GET', KEYS[1])} end
return {n, redis.call('GETRANGE', KEYS[1], 0, HEAD - 1)}
"""

# KEYS[1]: a manifest, KEYS[2..]: a version's chunks. ARGV: the bytes of each chunk but the last, of the last.
# Returns the manifest's first line (to its newline, HEAD bytes at most; '' for none, or a key of another type),
# its length, and how many of the chunks hold the bytes they should (one of another type holds none).
LOOK = _VERSION + """
local line = head(KEYS[1])
local newline = string.find(line, '\\n', 1, true)
if newline then line = string.sub(line, 1, newline) end
local whole = 0
for i = 2, #KEYS do
  if redis.pcall('STRLEN', KEYS[i]) == tonumber(ARGV[i == #KEYS and 2 or 1]) then whole = whole + 1 end
end
return {line, line ~= '' and redis.call('STRLEN', KEYS[1]) or 0, whole}
"""

# KEYS: the tenant's sorted set of ids, its map of bytes per session, their total. ARGV: a TTL in ms (0: none),
# a session id (''), how many ids to sample, whether to sum the total again from the map (a recount's last step:
# '1'), then pairs of session id and bytes (-1: unlisted). A key of another type is deleted first; a list gone
# (deleted so, or evicted) is made again from the map's ids; the total is kept equal to the map's sum (summed
# again where it is no count: none, garbled, or the map deleted). Returns the total, the session's bytes, up to
# that many ids at random from the list and as many from the map, the names of the keys deleted, and those of
# the keys made again from the map (the list made again, the total summed again to another count).
LIST = """
local kinds, lost, reset, remade = {'zset', 'hash', 'string'}, {}, {}, {}
for i, k in ipairs(KEYS) do
  local kind = redis.call('TYPE', k)['ok']
  if kind ~= 'none' and kind ~= kinds[i] then
    redis.call('DEL', k)
    lost[i] = true
    reset[#reset + 1] = k
  end
end
if redis.call('EXISTS', KEYS[1]) == 0 then
  local ids = redis.call('HKEYS', KEYS[2])
  for _, id in ipairs(ids) do redis.call('ZADD', KEYS[1], 0, id) end
  if #ids > 0 and not lost[1] then remade[#remade + 1] = KEYS[1] end
end
local function count(v)  -- a count of bytes, or false
  if v and #v < 16 and string.match(v, '^%d+$') then return tonumber(v) end
  return false
end
local function sum()
  local n = 0
  for _, v in ipairs(redis.call('HVALS', KEYS[2])) do n = n + (count(v) or 0) end
  return n
end
local stored = redis.call('GET', KEYS[3])
local was = not lost[2] and count(stored)
local total = was or sum()
for i = 5, #ARGV, 2 do
  local id, new = ARGV[i], tonumber(ARGV[i + 1])
  total = total - (count(redis.call('HGET', KEYS[2], id)) or 0)
  if new < 0 then
    redis.call('ZREM', KEYS[1], id)
    redis.call('HDEL', KEYS[2], id)
  else
    redis.call('ZADD', KEYS[1], 0, id)
    redis.call('HSET', KEYS[2], id, new)
    total = total + new
  end
end
if total < 0 then total = 0 end
if ARGV[4] == '1' then
  local summed = sum()
  if summed ~= total and was then remade[#remade + 1] = KEYS[3] end
  total = summed
end
if total ~= was and (stored or total > 0) then redis.call('SET', KEYS[3], string.format('%.0f', total)) end
if tonumber(ARGV[1]) > 0 and (#ARGV > 4 or #reset > 0 or #remade > 0 or total ~= was) then
  for _, k in ipairs(KEYS) do redis.call('PEXPIRE', k, ARGV[1]) end
end
local own = ARGV[2] ~= '' and count(redis.call('HGET', KEYS[2], ARGV[2])) or 0
local sample = {}
if tonumber(ARGV[3]) > 0 then
  local seen = {}
  for _, ids in ipairs({redis.call('ZRANDMEMBER', KEYS[1], ARGV[3]), redis.call('HRANDFIELD', KEYS[2], ARGV[3])}) do
    for _, id in ipairs(ids) do
      if not seen[id] then seen[id] = true; sample[#sample + 1] = id end
    end
  end
end
return {total, own, sample, reset, remade}
"""
